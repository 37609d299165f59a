"""tools/hopper_try.py, the device harness that picked the Hopper stages' shapes: the variant it
builds launches exactly the shapes it was given (read back by the registry's pick() reader)."""

import pytest

import flashlab as fl
from conftest import load_tool
from flashlab import picks

hopper_try = load_tool("hopper_try")


# The Hopper forward stages, whose pick() the tool rewrites (the tool times forwards over the
# sweep: fast stages; stages 19-21 take stage 13's forward by including its file, pick() and all)
@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.arch_specific and st.fast])
def test_a_variant_launches_the_shapes_it_names(slug):
    text = hopper_try.variant_source(fl.stage(slug), "D64:128,3,3;D64c:64,2,4;D128:64,2,5")
    assert picks.launched(text, 64, False, 4096) == ("128", "3", "3")
    assert picks.launched(text, 64, True, 4096) == ("64", "2", "4")
    assert picks.launched(text, 128, True, 512) == ("64", "2", "5")  # no causal shape: the other
    assert _outside_pick(text) == _outside_pick(fl.stage(slug).source.read_text())


def _outside_pick(text):
    return text[:text.index("// PICK")] + text[text.index('extern "C"'):]


def test_boundary_probes_fall_on_both_sides_of_every_n_boundary_of_a_pick():
    """The GPU check runs a stage at these lengths, so that every shape pick() launches is checked
    at a length it serves, ragged past the boundary."""
    text = hopper_try.variant_source(fl.stage("12"), "D64:128,3,2;D128:128,2,2")
    assert picks.boundary_probes(text) == []  # one shape per head dim and mask: nothing to add
    causal = "    if (p->causal) return launch<T, 64, 128,3,2>(p, s);\n"
    assert causal in text
    text = text.replace(causal, "    if (p->causal) {\n      if (p->N < 4096) return launch<T, 64, 128, 3, "
                        "2>(p, s);\n      return launch<T, 64, 128, 3, 3>(p, s);\n    }\n")
    assert picks.boundary_probes(text) == [(64, True, 4095), (64, True, 4163)]
    assert picks.launched(text, 64, True, 4095) == ("128", "3", "2")
    assert picks.launched(text, 64, True, 4163) == ("128", "3", "3")


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if picks.launched(
    st.source.read_text(), 64, True) is not None])
def test_a_launched_shape_is_named_as_the_registry_names_the_template(slug):
    st = fl.stage(slug)
    text = st.source.read_text()
    defaults = picks.launch_defaults(text)
    for D in st.head_dims:
        for causal in (False, True):
            for N in (512, 4096):
                args = picks.launched(text, D, causal, N)
                shape = picks.shape(slug, D, causal, N)
                assert list(shape)[:len(args)] == list(st.template[2:2 + len(args)])
                values = [str(v).lower() for v in shape.values()]
                assert values[:len(args)] == [a.lower() for a in args]
                # WITH_LSE is chosen at the launch (is the lse asked for?), not by pick()
                assert {k: str(v) for k, v in list(shape.items())[len(args):]} == {
                    k: defaults[k] for k in st.template[2 + len(args):] if k != "WITH_LSE"}
    assert picks.shape(slug, 96, False) is None  # no shape for a head dim the pick leaves out


def test_the_arguments_a_pick_leaves_out_are_the_launch_defaults():
    """Stage 09 launches `launch<T, 128, 128, 2, 3>` and `launch<T, 128, 64, 2, 2, 2, 1>`: the
    first leaves BLOCKS and RETIRE to their defaults, 1 and 0."""
    text = fl.stage("09").source.read_text()
    assert picks.launch_defaults(text) == {"BLOCKS": "1", "RETIRE": "0"}
    assert picks.shape("09", 128, False, 2048)["RETIRE"] == 0
    assert picks.shape("09", 128, False, 2048)["BLOCKS"] == 1
    assert picks.shape("09", 128, True, 2048)["RETIRE"] == 1
    assert picks.launch_defaults(fl.stage("08").source.read_text()) == {}
