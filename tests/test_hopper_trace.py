"""tools/hopper_trace.py, the device harness that reads a consumer's schedule from the SM clock:
the trace table and STAMP it adds compile into a stage's kernel, and its reading of a table."""

import numpy as np

import flashlab as fl
from conftest import load_tool, needs_nvcc
from flashlab import ptxas

hopper_trace = load_tool("hopper_trace")


def stamped(text):
    """Stage 11's consumer loop with a stamp before the data wait, after S and after the softmax."""
    for old, new in [
        ("  int ring = 0;\n  while (begin_item()) {", "  int ring = 0, tr = 0;\n  while (begin_item()) {"),
        ("      mbar_wait(k_full + 8 * buf, (ring / STAGES) & 1);\n      // With two blocks",
         "      STAMP(0);\n      mbar_wait(k_full + 8 * buf, (ring / STAGES) & 1);\n      STAMP(1);\n"
         "      // With two blocks"),
        ("      softmax(s, j * BC);\n", "      softmax(s, j * BC);\n      STAMP(2);\n      tr++;\n"),
    ]:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


@needs_nvcc
def test_a_stamped_stage_compiles_for_hopper(tmp_path):
    src = tmp_path / "11_traced.cu"
    src.write_text(hopper_trace.traced_source(stamped(fl.stage(11).source.read_text())))
    ptxas.compile_cubin(src, "sm_90a")  # the workbook's own flags; RuntimeError if it fails


def test_phases_are_the_mean_gaps_between_stamps():
    t = np.zeros((2, hopper_trace.TILES, hopper_trace.STAMPS), dtype=np.uint64)
    for wg in range(2):
        for tile in range(20):
            start = 1000 + 3000 * tile + 1500 * wg
            t[wg, tile, :3] = [start, start + 200, start + 1200]
    got = hopper_trace.phases(t, ["wait", "S"])
    assert got[0] == {"wait": 200.0, "S": 1000.0, "period": 3000.0}
    assert got[1]["period"] == 3000.0


def test_phases_stop_where_an_earlier_launch_left_its_stamps():
    # block 0 took 12 tiles in the launch read and more in one before it: the table holds the
    # read launch's tiles, then older (smaller) clock values from the earlier launch
    t = np.zeros((2, hopper_trace.TILES, hopper_trace.STAMPS), dtype=np.uint64)
    for wg in range(2):
        for tile in range(20):
            start = (10**9 if tile < 12 else 1000) + 3000 * tile
            t[wg, tile, :3] = [start, start + 200, start + 1200]
    got = hopper_trace.phases(t, ["wait", "S"])
    assert got[0] == {"wait": 200.0, "S": 1000.0, "period": 3000.0}


def test_the_stamps_written_say_how_many_names_the_intervals_need():
    t = np.zeros((2, hopper_trace.TILES, hopper_trace.STAMPS), dtype=np.uint64)
    assert hopper_trace.stamps_written(t) == 0
    for wg in range(2):
        for tile in range(20):
            t[wg, tile, :3] = [1000 + tile, 1200 + tile, 1300 + tile]
    assert hopper_trace.stamps_written(t) == 3
    t[1, 12, 2] = 0  # a stamp missing in one traced tile: the intervals after it are not known
    assert hopper_trace.stamps_written(t) == 2
