"""flashlab.diagrams on the CPU: the counts the notebooks predict from; every figure draws."""
import io

import numpy as np
import pytest
from matplotlib.figure import Figure

from flashlab import diagrams as dg
from flashlab.stages import stage

STAGES = ["01_naive", "02_coalesced"]


@pytest.mark.parametrize("D", [64, 128])
def test_stage01_lanes_read_one_column_of_32_rows(D):
    addr = dg.warp_addresses("01_naive", D=D, step=5)
    assert list(addr) == [(t * D + 5) * 4 for t in range(32)]


def test_stage02_lanes_read_consecutive_floats():
    addr = dg.warp_addresses("02_coalesced", D=64, warp=3)
    assert list(addr) == [(3 * 32 + t) * 4 for t in range(32)]


@pytest.mark.parametrize("D", [1, 40, 64, 100, 128])
def test_stage02_load_tile_covers_the_tile_once(D):
    trips = -(-32 * D // 1024)
    seen = np.concatenate([dg.warp_addresses("02_coalesced", D, step, w) // 4
                           for step in range(trips) for w in range(32)
                           if step * 1024 + w * 32 < 32 * D])
    assert sorted(seen) == list(range(32 * D))


def test_sectors_per_request_at_d64():
    assert dg.sectors_per_request(dg.warp_addresses("01_naive")) == (32, 32, 0.125)
    assert dg.sectors_per_request(dg.warp_addresses("02_coalesced")) == (4, 1, 1.0)


def test_sectors_per_request_edge_cases():
    assert dg.sectors_per_request([0] * 32).sectors == 1           # broadcast: one sector
    assert dg.sectors_per_request([30], access_bytes=4).sectors == 2  # straddles a boundary
    assert dg.sectors_per_request(np.arange(32) * 8).sectors == 8   # stride 2 floats


def test_bank_wavefronts():
    t = np.arange(32)
    assert dg.bank_wavefronts(t * 4) == 1            # consecutive words
    assert dg.bank_wavefronts(np.zeros(32)) == 1     # broadcast
    assert dg.bank_wavefronts(t * 64 * 4) == 32      # rows of 64 floats: one bank
    assert dg.bank_wavefronts(t * 2 * 4) == 2        # stride 2: two-way
    assert dg.bank_wavefronts(t * 65 * 4) == 1       # padded rows: conflict-free


def test_smem_counts_at_d64():
    s1, s2 = dg.smem_accesses("01_naive"), dg.smem_accesses("02_coalesced")
    assert s1["cycles"].sum() == 140288
    assert s2["cycles"].sum() == 71776
    kj = s2[s2["access"] == "Kj[tx*d + x]"].iloc[0]
    assert kj["wavefronts"] == 32                    # the bottleneck stage 03 removes
    assert (s2[s2["loop"] == "P·V"]["wavefronts"] == 1).all()
    ratio = dg.smem_bound_ms("01_naive") / dg.smem_bound_ms("02_coalesced")
    assert 1.9 < ratio < 2.0


@pytest.mark.parametrize("slug", STAGES)
def test_models_quote_the_kernels(slug):
    """Each access the model counts is still in the .cu file it was copied from."""
    text = stage(slug).source.read_text()
    for fragment in dg.smem_accesses(slug, with_source=True)["source"]:
        assert fragment in text, fragment
    load = {"01_naive": "K[qkv_offset + (size_t)key * d + x]",
            "02_coalesced": "src[(size_t)first * d + e]"}[slug]
    assert load in text


def test_wmma_traffic_at_d64():
    t = dg.wmma_smem_traffic()
    assert t["bytes"].sum() == 48 * 1024        # per warp and K/V tile, K/V copy share included
    trip = t[t["kind"] == dg.ROUND_TRIP]["bytes"].sum()
    assert trip == 28 * 1024                     # S, P and O: what stage 05 keeps in registers
    assert dg.wmma_flops() == 4 * 16 * 64 * 64
    assert (dg.wmma_smem_bytes(), dg.wmma_smem_bytes(D=128)) == (55296, 88064)  # Tiles::SMEM
    t128 = dg.wmma_smem_traffic(D=128).set_index("step")["bytes"]
    assert t128["QKᵀ: K fragments"] == 2 * t.set_index("step")["bytes"]["QKᵀ: K fragments"]


def test_wmma_model_quotes_the_kernel():
    text = stage("04_wmma").source.read_text()
    for fragment in dg.wmma_smem_traffic()["source"]:
        assert fragment.split(" ...")[0] in text, fragment


def test_serial_work():
    assert dg.serial_fmas("01_naive") == 4096
    assert dg.serial_fmas("02_coalesced") == 128


def test_only_modelled_stages():
    with pytest.raises(ValueError):
        dg.warp_addresses("03_coarsened")


def _renders(fig):
    assert isinstance(fig, Figure)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    return buf.tell() > 1000


@pytest.mark.parametrize("draw", [
    lambda: dg.access_pattern("01_naive"), lambda: dg.access_pattern("02_coalesced", D=128),
    dg.access_comparison, lambda: dg.thread_ownership("01_naive"),
    lambda: dg.thread_ownership("02_coalesced"), dg.loop_order, lambda: dg.loop_order("fa2"),
    lambda: dg.grid_fill(STAGES), lambda: dg.grid_fill("01_naive"), dg.wmma_dataflow,
    lambda: dg.wmma_dataflow(D=128),
])
def test_figures_render(draw):
    assert _renders(draw())


def test_titles_carry_the_counts():
    assert "32 sectors" in dg.access_pattern("01_naive").axes[0].get_title()
    assert "4 sectors" in dg.access_pattern("02_coalesced").axes[0].get_title()
    assert "1024 per (batch, head)" in dg.loop_order().axes[0].get_title()


@pytest.mark.parametrize("load, compute", [(700, 300), (300, 700), (400, 400), (1, 0.5)])
@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("latency", [0, 500])
def test_pipeline_schedule(load, compute, stages, latency, tiles=7):
    plan = dg.pipeline_schedule(load, compute, tiles, stages, latency=latency)
    assert (plan["load_start"] >= plan["load_issue"] + latency).all()   # the round trip first
    assert (plan["compute_start"] >= plan["load_end"]).all()            # never computes early
    assert (plan["compute_start"].diff().dropna() >= compute).all()     # one tile at a time
    assert (plan["load_start"].diff().dropna() >= load).all()           # one load at a time
    # a load never overwrites a buffer before the tile that used it is computed
    for k in range(stages, tiles):
        assert plan.at[k, "load_start"] >= plan.at[k - stages, "compute_end"]
    total = plan["compute_end"].iloc[-1]
    if stages == 1:
        assert total == pytest.approx(tiles * (latency + load + compute))
    if stages == 2 and latency == 0:
        assert total == pytest.approx(load + (tiles - 1) * max(load, compute) + compute)
    # once the loop is full, a tile every pipeline_period on average (latency-bound, the tiles
    # come in bursts of stages - 1)
    m = max(stages - 1, 1)
    period = (plan["compute_start"].iloc[-1] - plan["compute_start"].iloc[-1 - m]) / m
    assert period == pytest.approx(dg.pipeline_period(load, compute, stages, latency))


def test_pipeline_latency():
    """Deeper pipelines cover latency (Little's law): with compute 300 and load 100 a tile, two
    buffers hide the load when it has no latency; with a 500 round trip, a tile issued one tile
    ahead arrives 600 after its issue, so two buffers stall (a tile every 600) and three do not
    (two tiles in flight, 2 x 300 >= 600)."""
    load, compute, tiles = 100, 300, 40
    period = {(lat, s): dg.pipeline_schedule(load, compute, tiles, s, latency=lat)[
        "compute_start"].diff().iloc[-1] for lat in (0, 500) for s in (2, 3)}
    assert period[(0, 2)] == period[(0, 3)] == compute
    assert period[(500, 2)] == load + 500        # stalls: latency + transfer per tile
    assert period[(500, 3)] == compute           # hidden
    assert dg.pipeline_stages_needed(load, compute, 0) == 2
    assert dg.pipeline_stages_needed(load, compute, 500) == 3
    assert dg.pipeline_stages_needed(load, compute, 1200) == 6   # 5 x 300 >= 1300
    # bandwidth-bound (load > compute): no number of buffers beats the link, latency or not
    assert dg.pipeline_period(700, 300, 8, 500) == 700
    # the serial loop pays the latency every tile; the bound counts it
    assert dg.pipeline_speedup_bound(load, compute, 500, 2) == pytest.approx(900 / 600)
    assert dg.pipeline_speedup_bound(load, compute, 500, 3) == pytest.approx(900 / 300)
    with pytest.raises(ValueError):
        dg.pipeline_schedule(1, 1, latency=-1)


def test_pipeline_bound():
    assert dg.pipeline_speedup_bound(1, 1) == 2
    assert dg.pipeline_speedup_bound(3, 1) == pytest.approx(4 / 3)
    serial = dg.pipeline_schedule(3, 1, 1000, 1)["compute_end"].iloc[-1]
    piped = dg.pipeline_schedule(3, 1, 1000, 2)["compute_end"].iloc[-1]
    assert serial / piped == pytest.approx(4 / 3, rel=1e-3)
    with pytest.raises(ValueError):
        dg.pipeline_schedule(1, 1, stages=0)


def test_pipeline_timeline():
    fig = dg.pipeline_timeline(700, 300, tiles=5)
    assert _renders(fig)
    assert "at most 1.43x" in fig._suptitle.get_text()
    assert "5000 ns for 5 tiles" in fig.axes[0].get_title(loc="left")
    fig = dg.pipeline_timeline(100, 300, tiles=5, stages=3, latency=500)
    assert _renders(fig)
    title = fig._suptitle.get_text()
    assert "latency 500 ns" in title and "at most 3.00x" in title
    assert "4500 ns for 5 tiles" in fig.axes[0].get_title(loc="left")
    fig = dg.pipeline_timeline(100, 300, tiles=8, stages=3, latency=500, versus=2)
    assert _renders(fig)
    assert "at most 2.00x" in fig._suptitle.get_text()       # 600 a tile against 300
    assert fig.axes[0].get_title(loc="left").startswith("2 buffers")
    with pytest.raises(ValueError):
        dg.pipeline_timeline(1, 1, stages=2, versus=2)
