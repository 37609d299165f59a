"""Stage 08's autotune (flashlab.autotune, flashlab.picks) and notebook 08's helpers
(flashlab.tuning), without a GPU: the pick() rewrite on the real kernel (and that it still
compiles), `flashlab tune --apply` from a recorded table, that the kernel's table is what the
recorded one says, per-N choices, that every variant the tuner builds compiles, and the tuning
log's tables and figures on a synthetic log."""
import math
import re
import shutil

import numpy as np
import pandas as pd
import pytest

from flashlab import autotune as tune08
from flashlab import cli, paths, picks, ptxas, tables, tuning
from flashlab.configs import SWEEP

from conftest import needs_nvcc


GPU = "Synthetic GPU"
# A choice unlike the kernel's default, with causal and non-causal shapes apart.
CHOICE = {(64, False): (64, 4, 2, 2, 1, 15), (64, True): (64, 4, 2, 3, 1, 11),
          (128, False): (32, 4, 2, 2, 0, 13), (128, True): (64, 4, 1, 3, 1, 15)}


# ---------------------------------------------------------------- a synthetic tuning log

def _rate(D, causal, c, n):
    """Made-up TFLOP/s: larger shapes and every switch help, a little; rising with N."""
    bc, warps, wm, stages, q_regs, opts = c
    base = 100 + 10 * wm + bc / 16 + 3 * stages + 2 * q_regs + warps + 2 * bin(opts).count("1")
    return base * (1 - 256 / n / 4) * (0.8 if causal else 1.0) * (1.1 if D == 128 else 1.0)


def synthetic_log(gpu=GPU, time="2030-01-01T00:00:00Z", drop=("D128", "SKIP_RESCALE")):
    """Rows shaped like measure()'s: every candidate all on, the winner timed again and with each
    switch off, stage 07's shape all off, and the final choice where a switch was dropped (at
    D = 128 switching SKIP_RESCALE off is made to win)."""
    t = tune08
    rows = []

    def add(D, c, causals, variant, bonus=0.0):
        for causal in causals:
            for n in t.NS:
                rows.append(dict(zip(t.FIELDS, c), D=D, causal=causal, N=n, B=16384 // n,
                                 H=2048 // D, variant=variant,
                                 tflops=_rate(D, causal, c, n) + bonus, check_passed=True,
                                 gpu=gpu, torch="2.x", cuda="13.0", commit="abc", time=time))
    final = {}
    for D, cands in t.CANDIDATES.items():
        for c in cands:
            add(D, (*c, t.ALL_OPTS), (False, True), t.ALL)
        add(D, (*cands[0], 0), (False, True), t.STAGE07)
        best = max(cands, key=lambda c: _rate(D, False, (*c, 15), 4096))
        add(D, (*best, t.ALL_OPTS), (False, True), t.RETIMED)
        for sw, bit in t.SWITCHES.items():
            wins = (f"D{D}", sw) == drop
            causals = (True,) if sw == "WARP_SKIP" else (False, True)
            add(D, (*best, t.ALL_OPTS & ~bit), causals, f"without {sw}", 50.0 if wins else 0.0)
        for causal in (False, True):
            opts = t.ALL_OPTS & ~t.SWITCHES[drop[1]] if f"D{D}" == drop[0] else t.ALL_OPTS
            final[(D, causal)] = (*best, opts)
            if opts != t.ALL_OPTS:
                add(D, final[(D, causal)], (causal,), t.CHOSEN, 50.0)
    df = pd.DataFrame(rows)
    df = df.merge(t._scores(df), on=["D", "causal", "variant", *t.FIELDS])
    df["chosen"] = False
    for (D, causal), c in final.items():
        variant = t.RETIMED if c[-1] == t.ALL_OPTS else t.CHOSEN
        sel = (df["D"] == D) & (df["causal"] == causal) & (df["variant"] == variant)
        for f, v in zip(t.FIELDS, c):
            sel &= df[f] == v
        assert sel.any()
        df.loc[sel, "chosen"] = True
    return df, final


@pytest.fixture
def log_dir(empty_data_dir, monkeypatch):
    monkeypatch.setenv("FLASHLAB_GPU", GPU)  # the GPU the views show (no results recorded here)
    df, final = synthetic_log()
    df.to_csv(empty_data_dir / "tune08.csv", index=False)
    return empty_data_dir, df, final


# ---------------------------------------------------------------- pick() rewrite and --apply

def test_pick_source_round_trip_on_the_real_kernel():
    text = picks.source().read_text()
    new = picks.with_pick(text, CHOICE)
    assert new != text
    assert picks.read(new) == CHOICE
    assert picks.with_pick(new, CHOICE) == new  # rewriting with the same choice changes nothing
    # only the table moved: the rest of the file is byte for byte the same
    m_old, m_new = picks.PICK.search(text), picks.PICK.search(new)
    assert text[:m_old.start()] == new[:m_new.start()]
    assert text[m_old.end():] == new[m_new.end():]
    assert m_new.group(0).startswith(m_old.group(1))  # the // TUNED: line stays


def test_per_n_choice_round_trips_through_pick():
    by_n = dict(CHOICE)
    by_n[(64, True)] = {512: (64, 4, 1, 2, 1, 27), 1024: (128, 4, 2, 2, 0, 29),
                        2048: (128, 4, 2, 2, 0, 29)}
    by_n[(128, False)] = {512: (32, 4, 2, 3, 0, 31), 1024: (64, 4, 2, 2, 0, 31),
                          2048: (32, 4, 2, 3, 0, 31), 4096: (64, 8, 2, 2, 0, 31)}
    text = picks.with_pick(picks.source().read_text(), by_n)
    assert "if (p->N < 1024) return launch<T, 64, 64, 4, 1, 2, true, 27>(p, s);" in text
    segs = picks.read_by_n(text)
    assert segs[(64, True)] == [(1024, (64, 4, 1, 2, 1, 27)), (None, (128, 4, 2, 2, 0, 29))]
    assert segs[(128, False)] == [(1024, (32, 4, 2, 3, 0, 31)), (2048, (64, 4, 2, 2, 0, 31)),
                                  (4096, (32, 4, 2, 3, 0, 31)), (None, (64, 8, 2, 2, 0, 31))]
    assert segs[(64, False)] == [(None, CHOICE[(64, False)])]
    main = picks.read(text)
    assert main[(64, True)] == (128, 4, 2, 2, 0, 29) and main[(128, True)] == CHOICE[(128, True)]
    assert picks.segments({512: (1,), 1024: (1,)}) == [(None, (1,))]


def test_a_shape_serves_one_n_only_by_a_margin():
    best = (64, 4, 2, 2, 1, 31)
    other = (64, 4, 1, 2, 1, 31)

    def row(c, n, tflops):
        return dict(zip(tune08.FIELDS, c), D=64, causal=True, N=n, variant=tune08.ALL, tflops=tflops)
    df = pd.DataFrame([row(best, 512, 200), row(other, 512, 210),      # 5% faster: it serves 512
                       row(best, 1024, 240), row(other, 1024, 245),    # 2%: within the margin
                       row(best, 4096, 300), row(other, 4096, 250)])
    per_n = tune08._per_n(df, {(64, True): best})
    assert per_n == {(64, True): {512: other, 1024: best, 4096: best}}
    # the switch verdicts score a shape over the N it serves only
    assert tune08._geo(df, 64, True, tune08.ALL, best, [512, 1024]) == pytest.approx((200 * 240) ** 0.5)
    assert tune08._geo(df, 64, True, tune08.ALL, best, [2048]) == 0.0  # not timed there


def test_kernel_pick_reads_the_default_table():
    text = picks.source().read_text()
    pick = picks.read(text)
    assert set(pick) == {(D, c) for D in tune08.CANDIDATES for c in (False, True)}
    for (D, _), c in pick.items():
        assert len(c) == len(tune08.FIELDS) and 0 <= c[-1] <= tune08.ALL_OPTS


def test_with_pick_without_a_tuned_block_says_so():
    with pytest.raises(ValueError, match="TUNED"):
        picks.with_pick("template <typename T>\nstatic const char* pick() {}\n", CHOICE)


@needs_nvcc
def test_rewritten_kernel_compiles(tmp_path):
    src = tmp_path / "08_tuned.cu"
    src.write_text(picks.with_pick(picks.source().read_text(), CHOICE))
    found = ptxas.resources(src, "sm_90")
    want = {(D, *c) for (D, _), c in CHOICE.items()}
    names = " ".join(r.kernel for r in found)
    for D, *c in want:
        assert picks.kernel_name(D, c) in names
    assert len(found) == 4 * len(want)  # fp16 and bf16 of each, with and without the lse stores


def test_chosen_on_a_synthetic_table():
    df, final = synthetic_log()
    assert tune08.chosen(df) == final
    # a second GPU's chosen rows do not leak in once the caller filters, and duplicates collapse
    twice = pd.concat([df, df])
    assert tune08.chosen(twice) == final


def test_apply_rewrites_a_copy_of_the_kernel(log_dir, tmp_path, monkeypatch, capsys):
    data, df, final = log_dir
    # an older GPU whose choice must lose to the newer one
    other, _ = synthetic_log(gpu="Older GPU", time="2020-01-01T00:00:00Z", drop=("D64", "FOLD_SCALE"))
    pd.concat([other, df]).to_csv(data / "tune08.csv", index=False)
    kernel = tmp_path / "08_tuned.cu"
    shutil.copy(picks.source(), kernel)
    before = picks.source().read_text()
    monkeypatch.setattr(picks, "source", lambda: kernel)
    assert cli.main(["tune", "--apply"]) == 0
    assert picks.read(kernel.read_text()) == final
    assert kernel.read_text() == picks.with_pick(before, final)
    assert (paths.ROOT / "kernels" / "08_tuned.cu").read_text() == before  # the repo's untouched
    out = capsys.readouterr().out
    assert f"tuned on {GPU}" in out and "D=128 causal=True" in out


def test_apply_refuses_a_log_without_every_choice(log_dir, tmp_path, monkeypatch):
    data, df, _ = log_dir
    df[~(df["chosen"] & (df["D"] == 128) & df["causal"])].to_csv(data / "tune08.csv", index=False)
    kernel = tmp_path / "08_tuned.cu"
    shutil.copy(picks.source(), kernel)
    monkeypatch.setattr(picks, "source", lambda: kernel)
    with pytest.raises(ValueError, match=r"no chosen row .*\(128, True\)"):
        tune08.apply()
    assert kernel.read_bytes() == (paths.ROOT / "kernels" / "08_tuned.cu").read_bytes()


def test_kernel_table_is_what_the_recorded_log_says(tmp_path, monkeypatch):
    """Once data/tune08.csv is recorded, pick() must be `--apply`'s output from it: re-run
    `flashlab tune --apply` after tuning."""
    if tables.TUNE08.load().empty:
        pytest.skip("data/tune08.csv not recorded yet (flashlab tune on a GPU)")
    real = picks.source()
    kernel = tmp_path / real.name
    shutil.copy(real, kernel)
    monkeypatch.setattr(picks, "source", lambda: kernel)
    tune08.apply()
    assert kernel.read_text() == real.read_text(), \
        f"{real.name}'s pick() is stale: run `flashlab tune --apply`"


# ---------------------------------------------------------------- every candidate compiles


def _variants():
    """What measure() may build: every candidate all on, stage 07's shape all off."""
    jobs = [(D, (*c, tune08.ALL_OPTS)) for D, cands in tune08.CANDIDATES.items() for c in cands]
    return jobs + [(D, (*cands[0], 0)) for D, cands in tune08.CANDIDATES.items()]


def _ablations():
    return [(D, (*c, tune08.ALL_OPTS & ~bit)) for D, cands in tune08.CANDIDATES.items()
            for c in cands for bit in tune08.SWITCHES.values()]


@needs_nvcc
def test_every_variant_the_tuner_builds_compiles_for_sm_90():
    """Candidates, their ablations and stage 07's shape all compile and fit the register file.
    Spills are allowed (the tuner times them); the notebook shows them beside the timings."""
    jobs = _variants() + _ablations()
    res = tuning.resources(jobs, "sm_90")
    assert len(res) == len(jobs)
    assert (res["registers"] <= 255).all()


@needs_nvcc
def test_one_kstep_is_what_fits_64_key_tiles_at_d128():
    """The kernel's claim for ONE_KSTEP: BC 64, WM 2, Q re-read at D = 128 spills with K read as
    two k-steps (stage 07's way) and not one k-step at a time."""
    shape = (64, 4, 2, 2, 0)
    on, off = tune08.ALL_OPTS, tune08.ALL_OPTS & ~tune08.SWITCHES["ONE_KSTEP"]
    res = tuning.resources([(128, (*shape, on)), (128, (*shape, off))], "sm_90")
    assert res["spill_bytes"].tolist()[0] == 0 and res["spill_bytes"].tolist()[1] > 0


# ---------------------------------------------------------------- the tuning log: tables, figures


def test_the_log_says_what_to_run_when_nothing_is(empty_data_dir):
    with pytest.raises(tables.NotRecorded, match=r"flashlab tune"):
        tables.tune_log()


def test_the_log_is_the_gpu_showns(log_dir, monkeypatch):
    data, df, _ = log_dir
    newer, _ = synthetic_log(gpu="Newer GPU", time="2031-01-01T00:00:00Z")
    pd.concat([df, newer]).to_csv(data / "tune08.csv", index=False)
    assert set(tables.tune_log()["gpu"]) == {GPU}  # the GPU shown, not the one tuned last
    assert set(tables.tune_log("Newer GPU")["gpu"]) == {"Newer GPU"}
    with pytest.raises(tables.NotRecorded, match="nothing recorded on Nowhere"):
        tables.tune_log("Nowhere")


def test_switches_and_sequence_lengths_come_from_their_owners():
    """The autotune's switches are the kernel's `enum Opts`, its N the benchmark's sweep."""
    opts = re.search(r"enum Opts\s*\{(.*?)\}", picks.source().read_text(), re.S).group(1)
    assert tune08.SWITCHES == {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", opts)
                               if k != "ALL_OPTS"}
    assert tune08.ALL_OPTS == sum(tune08.SWITCHES.values())
    assert tune08.NS == SWEEP.ns


def test_verdicts_and_effects(log_dir):
    _, _, final = log_dir
    log = tables.tune_log()
    v = tuning.verdicts(log)
    assert len(v) == 4 * len(tune08.SWITCHES)
    dropped = v.loc["SKIP_RESCALE"].xs(128, level="D")
    assert not dropped["kept"].any() and (dropped["off_vs_on_pct"] > 0).all()
    assert v.drop("SKIP_RESCALE", level="switch")["kept"].all()
    assert v.loc["WARP_SKIP"].xs(False, level="causal")["without"].isna().all()  # not timed
    eff = tuning.effects({"WM 1 -> 2": {64: ((64, 4, 1, 2, 1), (64, 4, 2, 2, 1))},
                          "absent": {64: ((1, 1, 1, 1, 1), (64, 4, 2, 2, 1))}}, log)
    assert (eff.loc["WM 1 -> 2", "ratio"] > 1).all()
    assert eff.loc["absent", "ratio"].isna().all()
    table = tuning.per_n(log)
    assert list(table.index.get_level_values("N").unique()) == list(tune08.NS)
    assert len(table) == 4 * len(tune08.NS)
    shapes = log[log["variant"] == tune08.ALL]
    for (D, causal, n), r in table.iterrows():
        here = shapes[(shapes["D"] == D) & (shapes["causal"] == causal) & (shapes["N"] == n)]
        assert r["best"] == here["tflops"].max()


def test_figures_on_a_synthetic_log(log_dir):
    log = tables.tune_log()
    fig = tuning.candidates_figure(log)
    axes = fig.get_axes()
    assert len(axes) == 4
    for ax, (D, causal) in zip(axes, tuning.PANELS):
        cands = tune08.CANDIDATES[D]
        assert len(ax.patches) == len(cands)
        tab_red = pytest.approx((0.839, 0.153, 0.157), abs=0.01)
        red = [p for p in ax.patches if p.get_facecolor()[:3] == tab_red]
        assert len(red) == 1  # the chosen shape, once
        assert ax.patches[0].get_hatch() == "//"  # stage 07's shape
    fig = tuning.ablation_figure(log)
    for ax, (D, causal) in zip(fig.get_axes(), tuning.PANELS):
        labels = [t.get_text() for t in ax.get_yticklabels()]
        assert labels[:2] == ["stage 07's shape, all off", "chosen shape, all on"]
        assert ("without WARP_SKIP" in labels) == causal
        assert any(lb.startswith("chosen: without SKIP_RESCALE") for lb in labels) == (D == 128)
        heights = [p.get_width() for p in ax.patches]
        assert all(h > 0 for h in heights)


def test_figures_without_a_log_say_what_to_run(empty_data_dir):
    for draw in (tuning.candidates_figure, tuning.ablation_figure, tuning.verdicts):
        with pytest.raises(tables.NotRecorded):
            draw()


# ---------------------------------------------------------------- the predictions' arithmetic


def test_two_row_tiles_halve_kv_ldmatrix_per_flop():
    for D, BC in ((64, 64), (128, 32)):
        one, two = tuning.warp_tile(D, BC, WM=1), tuning.warp_tile(D, BC, WM=2)
        assert two["flops"] == 2 * one["flops"] and two["mma"] == 2 * one["mma"]
        assert two["ldmatrix_kv"] == one["ldmatrix_kv"]
        assert two["wavefronts"] == 4 * two["ldmatrix"]
    q = tuning.warp_tile(128, 32, WM=2, Q_REGS=False)
    assert q["ldmatrix_q"] == 2 * 128 // 16 and q["regs_q"] == 0
    # stage 05's count of the same loops (one row tile, Q in registers)
    from flashlab.fragments import tile_cost
    assert tuning.warp_tile(64, 64)["ldmatrix"] == tile_cost(64, 64, 64).ldmatrix
    b = tuning.block_tile(64, 64, 4, 1, 2)
    assert b["smem_bytes"] == (64 + 2 * 64 * 2) * 64 * 2 and b["BR"] == 64


def test_rescale_and_warp_skip_fractions():
    assert tuning.rescales_skipped(16, 1) == 0.0
    long, short = tuning.rescales_skipped(16, 256), tuning.rescales_skipped(16, 8)
    assert 0 < short < long < 1
    assert tuning.rescales_skipped(32, 64) < tuning.rescales_skipped(16, 64)
    # i.i.d. scores: the simulated count of rescales agrees with the formula
    rng = np.random.default_rng(1)
    run = np.maximum.accumulate(rng.standard_normal((4000, 16, 32)), axis=2)
    sim = 1 - (run[..., 1:] > run[..., :-1]).any(axis=1).sum(axis=1).mean() / 32 - 1 / 32
    assert sim == pytest.approx(tuning.rescales_skipped(16, 32), abs=0.01)
    assert tuning.warp_tiles_skipped(4096, 64, 64, 1) == 0.0  # BR == BC: nothing to skip
    frac = tuning.warp_tiles_skipped(4096, 128, 64, 2)
    assert 0 < frac < 0.05
    # one block of 4 warps x 32 rows, two key tiles: warps 0 and 1 skip the second
    assert math.isclose(tuning.warp_tiles_skipped(128, 128, 64, 2), 2 / 8)


def test_launch_efficiency():
    # equal blocks filling whole waves: nothing idles; one block more than the slots: half idle
    assert tuning.launch_efficiency(1024, 8, 64, 64, 32, False) == 1.0
    assert tuning.launch_efficiency(1024, 1, 64, 64, 15, False) == pytest.approx(16 / 15 / 2)
    # a single causal head on many slots waits for its longest block
    assert tuning.launch_efficiency(4096, 1, 64, 64, 64, True) == pytest.approx((64 * 65 / 2) / 64 / 64)
    assert tuning.launch_efficiency(4096, 64, 64, 64, 64, True) > 0.9
