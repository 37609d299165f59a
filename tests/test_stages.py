"""The stage registry: order, lookup, sources on disk, and a notebook for every stage."""
import pytest

import flashlab as fl
from flashlab import paths
from flashlab.dtypes import DTYPES

STAGES = fl.stages()
NOTEBOOK_SRC = paths.NOTEBOOKS / "src"


def test_stages_are_in_order():
    assert [st.number for st in STAGES][:3] == [1, 2, 3]
    assert [st.slug for st in STAGES][:3] == ["01_naive", "02_coalesced", "03_coarsened"]
    assert [st.number for st in STAGES] == list(range(1, len(STAGES) + 1))
    assert fl.stages() is not fl.stages()  # a fresh list: callers may not mutate the registry


@pytest.mark.parametrize("st", STAGES, ids=lambda st: st.slug)
def test_stage_fields(st):
    assert st.slug.startswith(f"{st.number:02d}_")
    assert st.name == st.slug
    assert st.source == paths.KERNELS / f"{st.slug}.cu"
    assert st.source.is_file(), f"{st.source} is missing"
    assert st.title and st.idea
    assert st.dtypes and set(st.dtypes) <= set(DTYPES)
    assert st.head_dims and all(d > 0 for d in st.head_dims)
    assert str(st).startswith(st.slug)


def test_every_kernel_file_is_a_stage():
    on_disk = sorted(p.stem for p in paths.KERNELS.glob("[0-9][0-9]_*.cu"))
    assert on_disk == [st.slug for st in STAGES]


def test_lookup_by_number_string_or_slug():
    st = fl.stage(3)
    assert st.slug == "03_coarsened"
    assert fl.stage("03") is st
    assert fl.stage("3") is st
    assert fl.stage("03_coarsened") is st
    assert fl.stage(3) == fl.stage("03") == fl.stage("03_coarsened")
    for s in STAGES:
        assert fl.stage(s.number) is fl.stage(s.slug) is fl.stage(f"{s.number:02d}") is s


@pytest.mark.parametrize("key", [0, 99, "99", "04_nope", "coarsened", "", None])
def test_unknown_stage_lists_the_stages(key):
    with pytest.raises(ValueError, match="no stage") as err:
        fl.stage(key)
    for st in STAGES:
        assert st.slug in str(err.value)


@pytest.mark.parametrize("st", STAGES, ids=lambda st: st.slug)
def test_every_stage_has_a_notebook_source(st):
    """Its notebook is notebooks/src/<slug>.py (an appendix, 08a, may stand beside it)."""
    assert (NOTEBOOK_SRC / f"{st.slug}.py").is_file(), \
        f"no notebook source notebooks/src/{st.slug}.py for {st.slug}: `flashlab new-stage` writes one"
    found = sorted(NOTEBOOK_SRC.glob(f"{st.number:02d}_*.py"))
    assert found == [NOTEBOOK_SRC / f"{st.slug}.py"], \
        f"several notebook sources for stage {st.number:02d}: {found}"


def test_stage_accepts_a_stage():
    st = fl.stage(3)
    assert fl.stage(st) is st


@pytest.mark.parametrize("st", STAGES, ids=lambda st: st.slug)
def test_every_stage_carries_its_facts(st):
    """What tools and tests need to know of a stage lives in its registry entry."""
    assert st.kernel.endswith("_kernel") and st.kernel in st.text
    assert len(st.min_cc) == 2 and tuple(st.min_cc) >= (7, 0)
    assert st.unavailable(st.min_cc, toolkit=False) is None
    assert st.unavailable((st.min_cc[0], st.min_cc[1] - 1) if st.min_cc[1] else
                          (st.min_cc[0] - 1, 9), toolkit=False) is not None
    assert set(st.template) <= {"T", "D", "BR", "BC", "WARPS", "WGS", "CONSUMERS", "BLOCKS", "RETIRE",
                                "WM", "STAGES", "Q_REGS", "OPTS", "WITH_LSE"}
    # a forward that writes the log-sum-exp only when asked has it as its last template argument
    assert "WITH_LSE" not in st.template or (st.lse and st.template[-1] == "WITH_LSE")
    assert not st.picks or "D" in st.template
    assert st.idea_metrics or st.number == 1, "which profile metrics does this stage's idea move?"
    assert "HMMA" in st.sass_evidence


def test_a_stage_takes_its_own_configs_and_no_other_dtype_or_head_dim():
    from flashlab.measure import configs_for
    for st in fl.stages():
        assert all(st.takes(c) for c in configs_for(st)), st.slug
        assert not st.takes(fl.Config(1, 1, 64, 64, False, "fp64"))
        if not st.any_head_dim:
            assert not st.takes(fl.Config(1, 1, 64, 96, False, st.dtypes[0]))
        assert st.takes(fl.Config(1, 1, 64, 64, True, st.dtypes[0])) == st.causal


def test_the_stage_before():
    """A notebook measures its stage against the one before it (stages.before)."""
    from flashlab.stages import before
    assert before(1) is None
    assert before("12_tma_store") is fl.stage(11)
    plain = [(st, prev) for prev, st in zip(fl.stages(), fl.stages()[1:]) if st.builds_on is None]
    assert len(plain) >= 12 and all(before(st) is prev for st, prev in plain)


def test_the_last_backward_is_the_last_one_that_is_not_a_deterministic_variant():
    """What a model trains through and ring attention runs by default: the last stage with a
    backward and a log-sum-exp, passing over a deterministic stage after it (slower by design)."""
    from flashlab.stages import last_backward
    st = last_backward()
    assert st.has_backward and st.lse and not st.deterministic
    later = [s for s in STAGES if s.number > st.number and s.has_backward]
    assert all(s.deterministic for s in later)
    assert any(s.deterministic for s in STAGES if s.has_backward)


def test_a_stage_can_build_on_one_that_is_not_the_previous_number(monkeypatch):
    """builds_on names the stage a stage improves on where it is not the one before it (a
    backward stage building on a forward one, say)."""
    import dataclasses
    import importlib

    stages = importlib.import_module("flashlab.stages")  # fl.stages is the function
    n = fl.stages()[-1].number + 1
    extra = dataclasses.replace(fl.stage(13), number=n, slug=f"{n}_extra", builds_on=5)
    monkeypatch.setattr(stages, "_STAGES", stages._STAGES + (extra,))
    assert stages.before(f"{n}_extra") is fl.stage(5)
    assert stages.before(13) is fl.stage(12)


def test_each_notebook_diffs_its_stage_against_the_one_it_builds_on():
    """The diff a notebook shows is against the registry's before(): nb.show_diff(old, new)."""
    import re

    from flashlab.stages import before
    for st in fl.stages():
        src = paths.ROOT / "notebooks" / "src" / f"{st.slug}.py"
        for old, new in re.findall(r'nb\.show_diff\("(\w+)", "(\w+)"', src.read_text()):
            if new == st.slug:
                assert before(st) is not None and old == before(st).slug, (st.slug, old)


def test_the_kernel_abi_numbers_the_dtypes_as_the_one_list_does():
    """kernels/flashlab.h's FlashlabDtype mirrors flashlab.dtypes.DTYPES: the binding passes a
    dtype's code, and a kernel reads it by the enum's names."""
    import re

    from flashlab import inputs
    header = (paths.KERNELS / "flashlab.h").read_text()
    enum = re.search(r"enum FlashlabDtype \{([^}]*)\}", header)[1]
    codes = {name: int(code) for name, code in re.findall(r"FLASHLAB_(\w+)\s*=\s*(\d+)", enum)}
    spelled = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
    assert {spelled[n]: c for n, c in codes.items()} == {n: d.code for n, d in DTYPES.items()}
    assert {inputs.DTYPE_NAMES[t]: c for t, c in inputs.DTYPE_CODES.items()} == \
        {n: d.code for n, d in DTYPES.items()}
