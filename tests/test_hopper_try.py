"""tools/hopper_try.py, the device harness that picked the Hopper stages' shapes: the variant it
builds launches exactly the shapes it was given (read back by the registry's pick() reader)."""

import pytest

import flashlab as fl
from conftest import load_tool
from flashlab import picks

hopper_try = load_tool("hopper_try")


@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.arch_specific])
def test_a_variant_launches_the_shapes_it_names(slug):
    text = hopper_try.variant_source(fl.stage(slug), "D64:128,3,3;D64c:64,2,4;D128:64,2,5")
    assert picks.launched(text, 64, False, 4096) == ("128", "3", "3")
    assert picks.launched(text, 64, True, 4096) == ("64", "2", "4")
    assert picks.launched(text, 128, True, 512) == ("64", "2", "5")  # no causal shape: the other
    assert _outside_pick(text) == _outside_pick(fl.stage(slug).source.read_text())


def _outside_pick(text):
    return text[:text.index("// PICK")] + text[text.index('extern "C"'):]
