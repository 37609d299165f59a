"""CPU tests of flashlab.tiling: the ownership maps, bank model and counts the stage 03 notebook
draws, checked against each other and against kernels/03_coarsened.cu itself."""
import io
import re

import numpy as np
import pytest

from flashlab import paths, tiling

SOURCE = (paths.KERNELS / "03_coarsened.cu").read_text()


@pytest.mark.parametrize("BR,BC", [(64, 64), (64, 32)])
def test_every_thread_owns_one_patch_and_the_tile_is_covered_once(BR, BC):
    owner = tiling.patch_owner(BR, BC)
    assert owner.min() >= 0  # nothing unowned (patch_owner asserts nothing is owned twice)
    counts = np.bincount(owner.ravel(), minlength=256)
    assert len(counts) == 256 and (counts == (BR // 16) * (BC // 16)).all()
    tx, ty = 5, 2  # rows ty + 16r, keys tx + 16c
    rows, keys = np.nonzero(owner == 16 * ty + tx)
    assert set(rows) == {ty + 16 * r for r in range(BR // 16)}
    assert set(keys) == {tx + 16 * c for c in range(BC // 16)}


@pytest.mark.parametrize("D", [64, 128])
def test_output_patch_is_float4_columns(D):
    owner = tiling.o_owner(64, D)
    assert owner.min() >= 0
    assert (np.bincount(owner.ravel(), minlength=256) == 4 * 4 * (D // 64)).all()
    rows, cols = np.nonzero(owner == 16 * 3 + 7)
    assert set(cols) == {4 * 7 + 64 * g + e for g in range(D // 64) for e in range(4)}


@pytest.mark.parametrize("D", [64, 128])
def test_padding_brings_the_k_read_to_the_minimum_wavefronts(D):
    padded, _ = tiling.bank_map(D + 4)
    unpadded, m = tiling.bank_map(D)
    distinct_bytes = 16 * 16  # 16 different K rows (tx), 16 bytes each; lanes 16-31 broadcast
    assert padded == distinct_bytes // tiling.WAVEFRONT_BYTES == 2
    assert unpadded == 16  # every row starts in the same bank
    assert set(np.nonzero(m.any(axis=0))[0]) == {0, 1, 2, 3}


def test_wavefront_model():
    assert tiling.wavefronts(np.zeros(32, int), 4)[0] == 1           # one address: broadcast
    assert tiling.wavefronts(np.arange(32), 1)[0] == 1               # 32 consecutive words
    assert tiling.wavefronts(4 * np.arange(32), 4)[0] == 4           # 512 bytes: 4 passes
    assert tiling.wavefronts(64 * np.arange(32), 1)[0] == 32         # stage 02's Kj[tx*d + x]
    # first-fit meets the lower bound on every load of both stages' inner loops
    for stage in ("02", "03"):
        for pad in (True, False):
            for _, (_, _, loads) in tiling._steps(stage, 64, pad).items():
                for _, vec, addr in loads:
                    words = {(a + i) for a in set(addr.tolist()) for i in range(vec)}
                    per_bank = max(np.bincount([w % 32 for w in words]))
                    bound = max(per_bank, -(-4 * len(words) // 128))
                    assert tiling.wavefronts(addr, vec)[0] == bound


def test_work_per_load_counts_the_code():
    w02 = tiling.work_per_load("02_coalesced").set_index("loop")
    w03 = tiling.work_per_load("03_coarsened").set_index("loop")
    assert w02.loc["S = QK^T", "ffma_per_load"] == 0.5            # 1 FMA per 2 scalar loads
    assert w02.loc["S = QK^T", "wavefronts"] == 1 + 32              # broadcast Q + 32-way K
    assert (w03["ffma"] == 64).all() and (w03["loads"] == 8).all()  # 64 FMAs per 8 float4
    assert (w03["wavefronts"] == 4 * 1 + 4 * 2).all()
    assert tiling.inner_loop_bound("03") > 0.8 > tiling.inner_loop_bound("03", pad=False)
    assert tiling.inner_loop_bound("02") < 0.02


def test_tiles_match_the_kernel():
    """The strides and launch shapes tiling.py assumes are the ones in the .cu file."""
    for decl in ("LDQ = D + 4", "LDK = D + 4", "LDV = D", "LDP = BC + 4",
                 "SMEM_FLOATS = BR * LDQ + BC * LDK + BC * LDV + BR * LDP", "THREADS = 256"):
        assert decl in SOURCE, decl
    assert re.search(r"D == 64\) return launch<64, 64, 64>", SOURCE)
    assert "return launch<128, 64, 32>" in SOURCE
    assert tiling.smem_bytes(64, 64, 64) == 4 * (64 * 68 * 3 + 64 * 64)


def test_occupancy():
    occ = tiling.occupancy(112, tiling.smem_bytes(), cc="9.0")
    assert occ["blocks"] == 2 and occ["limits"]["registers"] == 2 and occ["warps"] == 16
    assert tiling.occupancy(64, tiling.smem_bytes(), cc="9.0")["limits"]["shared memory"] == 3


def test_loop_order_traffic():
    fa1, fa2 = tiling.global_bytes("fa1"), tiling.global_bytes("fa2")
    tensor = 4 * 16 * 1024 * 64 * 4
    assert fa2["Q"] == fa2["O"] == tensor and fa2["m, l"] == 0
    assert fa1["K, V"] == 2 * tensor and fa1["Q"] == 32 * tensor
    assert sum(fa2.values()) < sum(fa1.values())


@pytest.mark.parametrize("draw", [tiling.register_tiles, tiling.bank_conflicts, tiling.loop_orders])
def test_figures_render(draw):
    fig = draw()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert len(fig.axes) == 2 and buf.getvalue()[:4] == b"\x89PNG"


def test_issue_and_busy_shares():
    # 64 warp slots per SM (H100: 2048 threads) on 4 schedulers: 16 warps each, each issuing a
    # sixteenth of its time, keep every scheduler issuing every clock.
    assert tiling.issue_share(100, 6.25, cc="9.0") == pytest.approx(1.0)
    assert tiling.issue_share(50, 6.25, cc="9.0") == pytest.approx(0.5)
    # 132 SMs, one wavefront per clock at 2 GHz for 1 ms: 2.64e8 wavefronts fill it.
    assert tiling.busy_share(2.64e8, 1.0, 132, clock_ghz=2.0) == pytest.approx(1.0)
    assert tiling.busy_share(2.64e8, 2.0, 132, clock_ghz=2.0) == pytest.approx(0.5)


def test_launch_wavefronts_counts_the_return_path():
    plain = tiling.launch_wavefronts()
    returned = tiling.launch_wavefronts(returned=True)
    assert 0 < plain < returned  # float4 loads cost at least 4 passes on the way back
    # Twice the batch, twice the wavefronts.
    assert tiling.launch_wavefronts(B=8) == 2 * plain


def test_conflict_shares():
    import pandas as pd
    p = pd.DataFrame({"a": [1.1e7, 1205, 10], "b": [1.1e7, 3091, 0]},
                     index=["smem_wavefronts", "smem_load_bank_conflicts", "smem_store_bank_conflicts"])
    t = tiling.conflict_shares(p)
    assert t.loc["b", "% of wavefronts (loads)"] == pytest.approx(100 * 3091 / 1.1e7)
    assert t.loc["a", "store conflicts"] == 10
