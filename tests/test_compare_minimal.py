"""tools/compare_minimal.py edits a checkout of the published kernel; the published code is not
in this repository, so these tests use a stand-in with the lines the edits expect."""
import sys

import pytest

from flashlab import paths

sys.path.insert(0, str(paths.ROOT / "tools"))
import compare_minimal as cm  # noqa: E402

STAND_IN = """#include <torch/types.h>
__global__
void forward_kernel(
    const float* Q,
    const int Bc,
    const int Br,
    float* O
) {
    int tx = threadIdx.x;
    int qkv_offset = (bx * gridDim.y * N * d) + (by * N * d);  // gridDim.y = nh
    int lm_offset = (bx * gridDim.y * N) + (by * N);  // offset for l and m
}

__global__
void backward_kernel() {}
"""


def test_the_variants_edit_only_the_forward_kernel():
    kernel = cm.forward_kernel(STAND_IN)
    assert "backward_kernel" not in kernel and "torch" not in kernel
    by_name = {name: edits for name, _, edits, _ in cm.VARIANTS}
    tiles = cm.edited(kernel, by_name["constexpr_tiles"])
    assert "constexpr int Bc = 32, Br = 32;" in tiles and "const int Bc_arg" in tiles
    wide = cm.edited(kernel, by_name["constexpr_tiles_64"])
    assert "size_t qkv_offset" in wide and "size_t lm_offset" in wide


def test_a_changed_published_kernel_stops_with_a_clear_message():
    kernel = cm.forward_kernel(STAND_IN).replace("const int Br,", "const int rows,")
    with pytest.raises(SystemExit, match="published code has changed"):
        cm.edited(kernel, cm.EDITS_CONSTEXPR)
