"""Each stage's technique shows in its machine code: static SASS counts for sm_80 and sm_90 (sm_90a
for the Hopper stages, the registry's static_archs), no GPU.

What each stage must (True) or must not (False) contain is part of its registry entry
(Stage.sass_evidence: flashlab.stages' COMMON_SASS plus the stage's own `sass`), so a new stage
brings its own expectations. Counts are static (instructions in the code).
"""
import pytest

import flashlab as fl
from flashlab import env, ptxas, sass, tables

try:
    TOOLS, WHY = (ptxas.nvcc(), sass.cuobjdump()), ""
except FileNotFoundError as err:
    TOOLS, WHY = None, str(err)
needs_tools = pytest.mark.skipif(TOOLS is None, reason=f"cannot disassemble: {WHY}")

STAGES = [st.slug for st in fl.stages()]
BUILDS = [(st.slug, arch) for st in fl.stages() for arch in st.static_archs]
ARCHS = sorted({arch for _, arch in BUILDS})


@pytest.mark.parametrize("st", fl.stages(), ids=lambda st: st.slug)
def test_every_stage_states_its_evidence_in_known_categories(st):
    assert set(st.sass_evidence) <= set(sass.CATEGORIES), st.slug
    assert "HMMA" in st.sass_evidence, f"{st.slug}: say whether it uses the tensor cores"


@needs_tools
@pytest.mark.parametrize("slug, arch", BUILDS)
def test_stage_technique_shows_in_sass(slug, arch):
    ev = sass.evidence(slug, arch)
    assert len(ev) >= 1, f"no kernel in the SASS of {slug}"
    st = fl.stage(slug)
    for kernel, row in ev.iterrows():  # each kernel as the registry says: forward, backward, ...
        for cat, wanted in st.evidence_for(kernel).items():
            assert row[cat] == wanted, \
                f"{slug} on {arch}: {kernel} {'lacks' if wanted else 'has'} {cat}"
    assert any(st.is_forward(k) for k in ev.index), f"no {st.kernel} in the SASS of {slug}"
    if st.has_backward:
        assert any(k.split("<")[0] == st.backward for k in ev.index), \
            f"no {st.backward} in the SASS of {slug}"


# --- the recorded evidence cannot go stale ---------------------------------------------------------

HOW = ("run `flashlab sass --record`, `flashlab sass --arch sm_80 --record` and "
       "`flashlab sass --arch sm_90a --record`")


@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_sass_is_from_the_current_kernels(arch):
    """Needs no toolkit: the recorded source hash is that of today's .cu files and headers."""
    rec = tables.SASS.load()
    rec = rec[rec["arch"] == arch]
    built = sass.for_arch(fl.stages(), arch)
    assert sorted(set(rec["stage"])) == sorted(st.slug for st in built), \
        f"data/sass.csv lacks stages for {arch}: {HOW}"
    for st in built:
        hashes = set(rec.loc[rec["stage"] == st.slug, "source_hash"])
        assert hashes == {ptxas.source_digest(st.source, arch)}, \
            f"{st.slug} changed since data/sass.csv was recorded for {arch}: {HOW}"


@needs_tools
@pytest.mark.parametrize("arch", ARCHS)
def test_recorded_sass_matches_instruction_mix_now(arch):
    rec = tables.SASS.load()
    rec = rec[rec["arch"] == arch]
    if set(rec["nvcc"]) != {ptxas.nvcc_version()}:
        pytest.skip(f"data/sass.csv was recorded with nvcc {sorted(set(rec['nvcc']))}, this is "
                    f"{ptxas.nvcc_version()}: other compilers emit other counts")
    now = sass.rows(arch=arch)
    key = tables.SASS.key
    both = rec[key + ["count"]].merge(now[key + ["count"]], on=key, how="outer",
                                           suffixes=("_recorded", "_now"))
    differ = both[both["count_recorded"] != both["count_now"]]  # NaN (a missing row) differs too
    assert differ.empty, f"data/sass.csv is stale; {HOW}:\n{differ.to_string(index=False)}"
    # ...and the recorded grouping is what instruction_mix's opcodes add up to.
    for st in sass.for_arch(fl.stages(), arch):
        mix = sass.instruction_mix(st.source, arch)
        by_cat = mix.dropna(subset=["category"]).groupby(["kernel", "category"])["count"].sum()
        mine = rec[(rec["stage"] == st.slug) & (rec["category"] != sass.TOTAL)]
        for row in mine.itertuples():
            assert by_cat.get((row.kernel, row.category), 0) == row.count, (st.slug, row)


# --- the parts, on canned text ---------------------------------------------------------------------

SASS = """
	code for sm_90
		Function : _Z3fooPf
	.headerflags	@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000fe20000000800 */
        /*0010*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;       /* 0x0000000402047981 */
        /*0020*/               @P1 LDG.E R8, desc[UR4][R2.64] ;
        /*0030*/                   HFMA2.MMA R3, -RZ, RZ, 0, 0 ;
        /*0040*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0050*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0060*/                   MUFU.EX2 R0, R0 ;
        /*0070*/                   MUFU.RCP R0, R0 ;
        /*0080*/                   FFMA.RZ R0, R0, R1, R2 ;
        /*0090*/                   LDS.U.128 R4, [R2] ;
        /*00a0*/              @!UPT LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*00b0*/                   STL [R1], R0 ;
        /*00c0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00d0*/                   EXIT ;
		Function : _Z3barv
        /*0000*/                   SHFL.BFLY PT, R0, R1, 0x1, 0x1f ;
        /*0010*/                   SHFL.BFLY PT, R0, R1, 0x2, 0x1f ;
"""


def test_parse_canned_sass():
    counts = sass.parse(SASS)
    assert list(counts) == ["_Z3fooPf", "_Z3barv"]
    foo = counts["_Z3fooPf"]
    assert foo["LDG.E.128"] == foo["LDG.E"] == foo["HMMA.16816.F32"] == 1
    assert foo["LDGSTS.E.BYPASS.128"] == foo["LDSM.16.M88.4"] == foo["LDS.U.128"] == 1
    assert sum(foo.values()) == 14  # the encoding lines are not instructions
    assert counts["_Z3barv"] == {"SHFL.BFLY": 2}


@pytest.mark.parametrize("opcode, cat", [
    ("LDG.E.128", "LDG.E.128"), ("LDG.E.128.CONSTANT", "LDG.E.128"), ("LDG.E", "LDG"),
    ("LDG.E.64", "LDG"), ("LDS.128", "LDS.128"), ("LDS.U.128", "LDS.128"), ("LDS", "LDS"),
    ("LDSM.16.M88.4", "LDSM"), ("LDGSTS.E.BYPASS.128", "LDGSTS"), ("STS.128", "STS"),
    ("STG.E.128", "STG"), ("HMMA.16816.F32", "HMMA"), ("HFMA2.MMA", None), ("MUFU.EX2", "MUFU.EX2"),
    ("MUFU.RCP", None), ("FFMA", "FFMA"), ("FFMA.RM", "FFMA"), ("SHFL.BFLY", "SHFL"),
    ("BAR.SYNC.DEFER_BLOCKING", "BAR"), ("LDL", "LDL"), ("STL.64", "STL"), ("LDC.64", None),
    ("UBLKCP.S.G", "UBLKCP"), ("UBLKRED.G.S.ADD.F32.RN", "UBLKRED"),
])
def test_category(opcode, cat):
    assert sass.category(opcode) == cat


def test_short_name_is_the_same_from_any_demangler():
    for name in ("void coarsened_kernel<64, 64, 64>(const float *, const float *, int)",
                 "void coarsened_kernel<64, 64, 64>(float const*, float const*, int)"):
        assert sass.short_name(name) == "coarsened_kernel<64, 64, 64>"
    assert sass.short_name("naive_kernel(const float *, int)") == "naive_kernel"
    assert sass.short_name("_Z3fooPf") == "_Z3fooPf"


def test_missing_cuobjdump_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(sass, "_find", lambda tool: None)
    with pytest.raises(FileNotFoundError, match="pip install nvidia-cuda-cuobjdump"):
        sass.cuobjdump()


@needs_tools
def test_disassembly_is_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(sass, "CACHE", tmp_path / "sass")
    src = fl.stage(1).source
    first = sass.disassemble(src, "sm_80")
    assert len(list((tmp_path / "sass").glob("01_naive-sm_80-*.sass"))) == 1
    monkeypatch.setattr(ptxas, "compile_cubin", lambda *a: pytest.fail("the cache was not used"))
    assert sass.disassemble(src, "sm_80") == first
    assert sass.disassemble("01", "sm_80") == first  # a stage key works as well as a path


@needs_tools
def test_record_replaces_an_arch(empty_data_dir, monkeypatch):
    monkeypatch.setattr(env, "commit", lambda: "0123456789")  # as from a clean checkout
    p = sass.record("sm_80", stages=["01"])
    first = tables.SASS.load(p)
    assert set(first["stage"]) == {"01_naive"} and len(first) == len(sass.CATEGORIES) + 1
    stale = first.assign(kernel="renamed_kernel")  # what a renamed kernel would leave behind
    stale.to_csv(p, index=False)
    sass.record("sm_80", stages=["01"])
    again = tables.SASS.load(p)
    assert set(again["kernel"]) == {"naive_kernel"} and len(again) == len(first)
    assert set(again["commit"]) == {env.commit()}
    assert set(again["nvcc"]) == {ptxas.nvcc_version()}


def test_record_refuses_uncommitted_code(empty_data_dir, monkeypatch):
    """A '-dirty' row fails test_results' check on a clean clone; refuse it before it is written."""
    monkeypatch.setattr(env, "commit", lambda: "0123456789-dirty")
    with pytest.raises(ValueError, match="uncommitted"):
        sass.record("sm_80", stages=["01"])
    assert not (empty_data_dir / "sass.csv").exists()


@needs_tools
def test_cli_prints_the_grouped_table(capsys):
    from flashlab.cli import main
    assert main(["sass", "02", "--arch", "sm_80"]) == 0
    out = capsys.readouterr().out
    assert "static SASS" in out and "coalesced_kernel" in out and "LDG.E.128" in out


LOOPED = """
		Function : _Z4loopv
        /*0000*/                   MOV R0, RZ ;
        /*0010*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0020*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/               @P0 BRA P1, 0x70 ;
        /*0060*/                   BRA 0x60;
        /*0070*/                   EXIT ;
"""


def test_listing_finds_branch_targets():
    ins = sass.listing(LOOPED)["_Z4loopv"]
    assert [t for *_, t in ins] == [None, None, None, 0x10, None, 0x70, 0x60, None]
    assert sass.parse(LOOPED)["_Z4loopv"]["BRA"] == 3


def test_loops_on_canned_text(monkeypatch):
    monkeypatch.setattr(sass, "disassemble", lambda source, arch: LOOPED)
    monkeypatch.setattr(sass.ptxas, "kernel_names", lambda names: ["loop()"])
    found = sass.loops("x.cu")
    # one loop: the BRA to itself after EXIT is the usual trap, not a loop
    assert found[["first", "last", "instructions"]].values.tolist() == [["0x10", "0x30", 3]]
    assert found.iloc[0]["HMMA"] == found.iloc[0]["LDSM"] == 1


@needs_tools
def test_the_kv_loop_of_stages_05_to_07():
    """One loop per kernel, the K/V loop: the same 64 HMMA and 32 LDSM per trip at D=64, the
    swizzle's addresses hoisted out of it; 07 copies with LDGSTS inside it, 05 and 06 with LDG."""
    body = {s: sass.loops(s, kernel=k).iloc[0] for s, k in [
        ("05_mma", "mma_kernel<__half, 64, 64, 64, false>"),
        ("06_swizzle", "swizzle_kernel<__half, 64, 64, 64, false>"),
        ("07_cp_async", "cp_async_kernel<__half, 64, 64, 64, 2, false>")]}
    for b in body.values():
        assert b["HMMA"] == 64 and b["LDSM"] == 32
    assert body["05_mma"]["LDG.E.128"] == body["06_swizzle"]["LDG.E.128"] == 8
    assert body["07_cp_async"]["LDGSTS"] == 8 and body["07_cp_async"]["LDG.E.128"] == 0


@needs_tools
@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.sass_evidence.get("HGMMA")])
def test_wgmma_descriptors_are_built_once_not_moved_every_tile(slug):
    """HGMMA reads its shared-memory descriptors from uniform registers. The warpgroup index they
    depend on is read from lane 0, so ptxas knows it is warp-uniform and builds them there, once.
    In each kernel's K/V loop (sass.kv_loops) R2UR, a move from an ordinary register, is left
    only where stage 10 issues TMA copies from the loop: their tile coordinate, at most one per
    copy. With the index computed from threadIdx.x alone, stage
    09's loop at D = 128 had 48 R2UR and stage 10's 68 beside its 4 copies. A loop that issues
    S = Q K^T a second time on a rare path (stage 13's two-blocks fallback, which computes S
    again after a failed vote) may move one value for that second S."""
    st = fl.stage(slug)
    for kernel, kv in sass.kv_loops(sass.loops(st.source, "sm_90a")).iterrows():
        if kernel.split("<")[0].split()[-1] != st.kernel:
            continue  # the forward's K/V loop (stages 19-21 include stage 13's; not the backward's)
        args = dict(zip(st.template, ptxas.template_args(kernel)))
        D, BC = int(args["D"]), int(args["BC"])
        per_tile = D // 16 + BC // 16  # S's k-steps, then P V's
        assert kv["HGMMA"] in (per_tile, per_tile + D // 16), (kernel, kv["HGMMA"])
        again = (kv["HGMMA"] - per_tile) // (D // 16)
        assert kv["R2UR"] <= kv["UTMALDG"] + again, \
            f"{slug}: {kernel}'s K/V loop moves {kv['R2UR']} values with R2UR ({kv['UTMALDG']} copies)"


def test_operand_registers():
    assert sass._regs("HMMA.16816.F32", 1, "R4") == {4, 5, 6, 7}  # A: four registers
    assert sass._regs("HMMA.16816.F32", 2, "R12") == {12, 13}  # B: two
    assert sass._regs("LDSM.16.M88.4", 0, "R20") == {20, 21, 22, 23}
    assert sass._regs("LDSM.16.M88.2", 0, "R20") == {20, 21}
    assert sass._regs("FADD", 1, "-R7") == {7}
    assert sass._regs("LDS.128", 1, "[R3+0x40]") == {3}  # an address reads its base
    assert sass._regs("FADD", 1, "UR4") == set() and sass._regs("MOV", 1, "RZ") == set()


@needs_tools
def test_load_use_in_stage_08s_main_loop():
    """ptxas schedules most of stage 08's ldmatrix loads several mma ahead of their first use:
    the notebook's argument that register double-buffering in the source has little left to do."""
    kernel = "tuned_kernel<__half, 128, 64, 4, 2, 2, false, 31, false>"
    df = sass.load_use(fl.stage("08_tuned").source, kernel)
    body = sass.loops(fl.stage("08_tuned").source, kernel=kernel)
    longest = body.loc[body["instructions"].idxmax()]
    assert len(df) == longest["LDSM"] == 80  # every load of the loop, each with a use found
    assert (df["instructions"] > 0).all() and df["hmma"].median() >= 4
    assert (df["hmma"] == 0).sum() <= 6  # the first loads after a barrier or the softmax
    with pytest.raises(ValueError, match="no kernel"):
        sass.load_use(fl.stage("08_tuned").source, "nope<1>")


def test_cli_names_the_arch_a_hopper_stage_is_built_for(capsys):
    """No toolkit needed: the request is refused before anything compiles."""
    from flashlab.cli import main
    hopper = next(st for st in fl.stages() if st.arch_specific)
    assert main(["sass", hopper.slug, "--arch", "sm_80"]) == 2
    assert f"{hopper.slug} is built for sm_90a, not sm_80" in capsys.readouterr().err


def test_a_lesson_table_shows_only_the_instructions_met_so_far(monkeypatch):
    def no_tools(*args, **kwargs):
        raise OSError("no nvcc here")
    # from data/sass.csv, as where nvcc or cuobjdump is missing: the same columns either way
    monkeypatch.setattr(sass, "table", no_tools)
    from flashlab import notebook as nb
    from flashlab.stages import introduced_through
    assert "HGMMA" not in introduced_through(6) and "LDL" in introduced_through(6)
    assert {"HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"} <= introduced_through(12)
    ampere = nb.instruction_mix("05_mma", "06_swizzle")
    assert {"HMMA", "LDSM", "LDL", "STL", sass.TOTAL} <= set(ampere.columns)
    assert not {"HGMMA", "UTMALDG", "UTMASTG", "SYNCS", "USETMAXREG", "LDGSTS"} & set(ampere.columns)
    assert set(ampere.index.get_level_values("stage")) == {"05_mma", "06_swizzle"}
    # the stage that brings an instruction shows it, and the one before it shows its zero
    hopper = nb.instruction_mix("08_tuned", "09_wgmma")
    assert (hopper.loc["08_tuned", "HGMMA"] == 0).all() and (hopper.loc["09_wgmma", "HGMMA"] > 0).all()
    assert "UTMALDG" not in hopper.columns
    # a category no stage names as its evidence still shows where a kernel uses it
    assert "R2UR" not in introduced_through(9) and (hopper["R2UR"] > 0).any()
