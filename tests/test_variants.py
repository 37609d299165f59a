"""A stage's variants (flashlab.variants, the registry's Variant entries): each patch in kernels/
applies to its stage and builds for the stage's target without ptxas serializing wgmma or
spilling; the patch holds no exercise's code, and applied to a student's edition it runs the
student's own regions; a patch made on another version of the kernel is refused."""
import re

import pytest

from conftest import needs_nvcc
from flashlab import markers, paths, ptxas, variants
from flashlab.stages import stage, stages

VARIANTS = [v for st in stages() for v in st.variants]


def test_stage_12_has_the_two_overlaps_and_their_base():
    assert [v.name for v in stage(12).variants] == ["no_overlap", "in_warpgroup", "ping_pong"]
    assert stage(12).variant("ping_pong").slug == "12_tma_store+ping_pong"
    with pytest.raises(ValueError, match="no_overlap, in_warpgroup, ping_pong"):
        stage(12).variant("ping")
    with pytest.raises(ValueError, match="none"):
        stage(5).variant("ping_pong")


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.slug)
def test_a_variant_applies_to_its_stage_and_keeps_its_regions(v):
    st = stage(v.stage)
    text = variants.source(v)
    assert f"{v.kernel}<" in text
    base = {(r.kind, r.id): r.body for r in markers.regions(st.source.read_text())}
    for r in markers.regions(text, v.slug):
        assert base[(r.kind, r.id)] == r.body, r.id


@pytest.mark.parametrize("name", sorted({v.patch for v in VARIANTS}))
def test_a_variant_patch_holds_no_region_code(name):
    """No line of any exercise's solution or carried copy appears in the patch (so it ships in
    every edition that has its stage)."""
    patch = (paths.KERNELS / name).read_text()
    changed = {markers.normalize(ln[1:]) for ln in patch.splitlines() if ln[:1] in "+- "}
    st = stage(int(name[:2]))
    for r in markers.regions(st.source.read_text()):
        for line in markers.solution_lines(r):
            assert line not in changed, (r.id, line)


@pytest.mark.parametrize("through,first", [(13, 12), pytest.param(13, 5, marks=pytest.mark.slow)])
def test_an_edition_has_the_variants_kernel_and_runs_the_students_regions(tmp_path, through, first):
    """An edition keeps the markers of the exercises it hands out only, so it gets each variant
    of its stages as a kernel (kernels/variants/NN_x.cu) with those regions stubbed, in place of
    the patch; built there, the variant carries the student's code in them (here the stubs)."""
    from flashlab.course import student
    a = student.assignment(through, first)
    files, out = student.plan(paths.ROOT, a)
    v = stage(12).variant("ping_pong")
    copy = f"kernels/variants/{v.patch.replace('.patch', '.cu')}"
    assert f"kernels/{v.patch}" not in files and copy in out[f"kernels/{v.patch}"]
    for rel, data in files.items():
        if rel.startswith("kernels/"):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_bytes(data)
    handed = {ex.id for ex in a.exercises(paths.ROOT) if ex.kind == "kernel"}
    in_copy = {r.id for r in markers.regions((tmp_path / copy).read_text())}
    assert in_copy <= handed
    assert ("05.quad_sum" in in_copy) == (first <= 5)
    text = variants.source(v, kernels=tmp_path / "kernels")
    assert all(r.unwritten for r in markers.regions(text) if r.id in handed)
    assert f"{v.kernel}<" in text


@pytest.mark.slow
def test_an_edition_before_the_stage_has_no_variant():
    from flashlab.course import student
    files, out = student.plan(paths.ROOT, student.assignment(8, 7))
    assert not any("variants/" in rel or rel.endswith(".patch") for rel in files)


def test_a_patch_made_on_another_kernel_is_refused():
    v = stage(12).variant("in_warpgroup")
    other = stage(11).source.read_text()
    with pytest.raises(ValueError, match="does not match"):
        variants.apply(variants.collapse(other), (paths.KERNELS / v.patch).read_text())


def test_make_patch_round_trips():
    st = stage(12)
    text = variants.source(st.variant("ping_pong"))
    base = st.source.read_text()
    patch = variants.make_patch(base, text)
    assert variants.expand(variants.apply(variants.collapse(base), patch), base) == text


def test_with_pick_sets_the_shapes():
    text = variants.with_pick(stage(12).source.read_text(), "D64:128,3,2,1;D64c:64,3,2,2;D128:128,2,2,1")
    assert "if (p->causal) return launch<T, 64, 64,3,2,2>(p, s);" in text
    assert "return launch<T, 128, 128,2,2,1>(p, s);" in text
    with pytest.raises(ValueError, match="no pick"):
        variants.with_pick("int x;", "D64:1")


@needs_nvcc
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.slug)
def test_a_variant_builds_for_its_target_without_spills(tmp_path, v):
    st = stage(v.stage)
    out = tmp_path / f"{v.slug.replace('+', '_')}.cu"
    out.write_text(variants.source(v))
    arch = st.arch(st.min_cc)
    cubin = ptxas.compile_cubin(out, arch)
    assert not re.search(r"C75\d\d", cubin.report), cubin.report
    found = ptxas.parse(cubin.report, arch)
    assert found and all(r.spill_bytes == 0 for r in found), found


@pytest.mark.gpu
def test_on_hopper_each_variant_passes_the_check_and_is_timed_beside_its_stage(data_dir):
    """Built, checked against float64 (every variant passes) and timed in turn with stage 12 at
    two configs; the rows land in data/variants.csv, and the lesson's tables read them."""
    st = stage(12)
    if st.unavailable() is not None:
        pytest.skip(st.unavailable())
    from flashlab import tables, tma_store
    from flashlab.configs import Config
    at = [Config(4, 16, 1024, 64, True, "fp16"), Config(4, 16, 4096, 128, False, "fp16")]
    rows = variants.measure(st, at=at)
    assert rows["check_passed"].all() and len(rows) == len(st.variants) * len(at)
    assert (rows["ratio"] > 0.3).all() and (rows["ratio"] < 3).all()
    keys = ["variant", "B", "H", "N", "D", "causal"]
    recorded = tables.variant_rows(st, rows["gpu"].iloc[0])
    assert len(recorded.merge(rows[keys], on=keys)) == len(rows)  # beside any recorded before
    wide = tma_store.overlaps(measure=False)
    assert "ping_pong / in_warpgroup" in wide.columns
    assert {(c.D, c.causal, c.N) for c in at} <= set(wide.index)


@pytest.mark.gpu
def test_on_hopper_a_variant_is_profiled_under_its_own_name(data_dir):
    st = stage(12)
    if st.unavailable() is not None:
        pytest.skip(st.unavailable())
    from flashlab import profile
    ok, why = profile.available()
    if not ok:
        pytest.skip(why)
    from flashlab.configs import Config
    df = profile.profile(st, Config(4, 16, 1024, 128, False, "fp16"), variant="ping_pong")
    assert set(df["stage"]) == {"12_tma_store+ping_pong"} and "tensor_pipe_pct" in set(df["metric"])
