"""Nsight Compute profiling, the parts that need no GPU: parsing, units, conventions, errors."""
import re

import pytest

import flashlab as fl
from flashlab import profile as prof

RAW = '''==PROF== Connected to process 1234
"ID","Process ID","Process Name","Host Name","Kernel Name","gpu__time_duration.sum","dram__bytes.sum","l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum","l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","smsp__warp_issue_stalled_barrier_per_warp_active.pct"
"","","","","","nsecond","Mbyte","sector","request","","%"
"0","1234","python3","host","coalesced_kernel","38,561,234","1,234.5","800,000","200,000","4,096","12.5"
'''


def test_parse_raw_csv_reads_values_and_units():
    raw = prof.parse_raw_csv(RAW)
    assert raw["gpu__time_duration.sum"] == (38561234.0, "nsecond")
    assert raw["dram__bytes.sum"] == (1234.5, "Mbyte")


def test_values_convert_units_and_ratios():
    chosen = {"duration_ms": "gpu__time_duration.sum", "dram_bytes": "dram__bytes.sum",
              "global_load_sectors_per_request": ("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
                                                  "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"),
              "smem_load_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
              "stall_barrier": "smsp__warp_issue_stalled_barrier_per_warp_active.pct",
              "tensor_pipe_pct": "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"}
    got = {m: (v, u) for m, v, u, _ in prof._values(prof.parse_raw_csv(RAW), chosen)}
    assert got["duration_ms"] == (pytest.approx(38.561234), "ms")
    assert got["dram_bytes"] == (pytest.approx(1.2345e9), "bytes")
    assert got["global_load_sectors_per_request"][0] == pytest.approx(4.0)
    assert got["smem_load_bank_conflicts"][0] == 4096
    assert got["stall_barrier"] == (12.5, "%")
    assert "tensor_pipe_pct" not in got  # not in this profile: left out, not invented


def test_parse_raw_csv_without_a_profile_is_an_error():
    with pytest.raises(RuntimeError, match="no profile"):
        prof.parse_raw_csv("==PROF== Disconnected\n")


@pytest.mark.parametrize("st", fl.stages(), ids=lambda s: s.slug)
def test_every_stage_defines_the_kernel_its_registry_entry_names(st):
    """ncu and compute-sanitizer select the stage's kernel by this name."""
    assert re.search(rf"__global__[^;{{]*\b{st.kernel}\s*\(", st.text, re.S)


@pytest.mark.parametrize("st", fl.stages(), ids=lambda s: s.slug)
def test_every_idea_metric_is_one_flashlab_profiles(st):
    assert set(st.idea_metrics) <= set(prof.NCU), st.slug


def test_every_flashlab_metric_has_an_ncu_source():
    from flashlab.profile_schema import METRICS, STALL_REASONS
    assert set(METRICS) | {f"stall_{r}" for r in STALL_REASONS} == set(prof.NCU)


def test_profile_without_gpu_says_why(monkeypatch):
    monkeypatch.setattr(prof, "gpu_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        prof.profile("02")


def test_load_without_recordings_is_empty(empty_data_dir):
    from flashlab import tables
    df = tables.PROFILE.load()
    assert df.empty and list(df.columns)[:9] == tables.PROFILE.key
    assert tables.profile_rows("any GPU") is None


def test_source_view_of_the_recorded_swizzle_has_no_excess_wavefronts():
    """ncu's per-instruction view, recorded on the H100: every ldmatrix of stages 05 (padded) and
    06 (swizzled) took exactly its ideal number of wavefronts."""
    from flashlab import profile as prof
    for slug in ("05_mma", "06_swizzle"):
        try:
            by_op = prof.shared_by_opcode(slug)
        except fl.tables.NotRecorded:
            pytest.skip(f"no recorded source view of {slug}")
        assert by_op.loc["LDSM", "wavefronts"] > 0
        assert by_op.loc["LDSM", "excessive"] == 0
        assert (by_op["wavefronts"] == by_op["ideal"] + by_op["excessive"]).all()


def test_source_view_parser_reads_excess():
    from flashlab.profile import shared_by_instruction
    text = ('"Kernel Name","k"\n'
            '"Address","Source","L1 Wavefronts Shared Excessive","L1 Wavefronts Shared",'
            '"L1 Wavefronts Shared Ideal"\n'
            '"0x10","LDSM.16.M88.4 R4, [R2]","0","64","64"\n'
            '"0x20","@P0 STS.128 [R3], R8","32","96","64"\n'
            '"0x30","IADD3 R1, R1, 1, RZ","0","0","0"\n')
    df = shared_by_instruction(text)
    assert list(df["opcode"]) == ["LDSM", "STS"]
    assert df["excessive"].tolist() == [0, 32]
