"""The recorded tables (flashlab.tables): the results table's upsert by key, its contract
columns and SDPA percentages, every table's types, and the write itself (atomic rename under a
file lock, safe with several processes at once)."""
import csv
import math
import multiprocessing
import os

import pandas as pd
import pytest

from flashlab import tables
from flashlab.tables import RESULTS as results


def row(stage, tflops=1.0, gpu="NVIDIA Test GPU", N=1024, D=64, dtype="fp32", causal=False,
        status="ok", **extra):
    r = dict(stage=stage, kind="baseline" if stage.startswith(("sdpa_", "torch_")) else "stage",
             dtype=dtype, B=4, H=16, N=N, D=D, causal=causal, gpu=gpu, status=status,
             median_ms=1.0, tflops=tflops, rel_err=1e-7, p20_ms=0.9, p80_ms=1.1,
             time="2026-01-01T00:00:00Z")
    r.update(extra)
    return r


def error_row(stage, **kw):
    """A row as _record_crash writes it: no timings at all."""
    return dict(stage=stage, kind="stage", dtype="fp32", B=4, H=16, N=1024, D=64, causal=False,
                gpu=kw.pop("gpu", "NVIDIA Test GPU"), status="error", note="worker exited with -11",
                **kw)


def one(df, **where):
    sel = df
    for k, v in where.items():
        sel = sel[sel[k] == v]
    assert len(sel) == 1, f"{len(sel)} rows match {where}:\n{df}"
    return sel.iloc[0]


def test_path_follows_flashlab_data(empty_data_dir):
    for table in tables.ALL:
        assert table.path() == empty_data_dir / table.name


def test_load_without_a_table(empty_data_dir):
    df = results.load()
    assert df.empty
    assert list(df.columns) == results.columns


def test_a_row_says_its_pass_and_gpu_count_and_older_rows_read_as_forward_on_one(empty_data_dir):
    """pass and gpus are in the key: a backward row, or one timed on a ring of 4 GPUs, stands
    beside the forward row of the same config; a table written before the columns existed reads
    as forward passes on one GPU; the sweep's queries read forward rows of one GPU."""
    old = pd.DataFrame([row("05_mma", N=512, B=32, H=32, dtype="fp16")])
    old.to_csv(results.path(), index=False)
    df = results.load()
    assert list(df["pass"]) == ["forward"] and list(df["gpus"]) == [1]
    df = results.upsert([row("05_mma", N=512, B=32, H=32, dtype="fp16", tflops=2.0,
                             **{"pass": "backward"}),
                         row("05_mma", N=512, B=32, H=32, dtype="fp16", tflops=3.0, gpus=4)])
    assert len(df) == 3 and not df.duplicated(results.key).any()
    with open(results.path(), newline="") as f:
        assert {"pass", "gpus"} <= set(next(csv.reader(f)))
    assert list(tables.sweep_rows(df, "NVIDIA Test GPU")["tflops"]) == [1.0]
    assert list(tables.sweep_rows(df, "NVIDIA Test GPU", pass_="backward")["tflops"]) == [2.0]
    cfg = tables.Config(32, 32, 512, 64, False, "fp16")
    assert list(tables.at_config(df, cfg)["tflops"]) == [1.0, 3.0]


def test_upsert_inserts_and_replaces_by_key(empty_data_dir):
    results.upsert([row("01_naive", tflops=1.0)])
    results.upsert([row("01_naive", tflops=2.0, median_ms=0.5, note="newer")])
    df = results.load()
    assert len(df) == 1
    r = one(df, stage="01_naive")
    assert r.tflops == 2.0 and r.median_ms == 0.5 and r.note == "newer"
    results.upsert([row("01_naive", tflops=3.0), row("01_naive", tflops=4.0)])  # last one wins
    assert one(results.load(), stage="01_naive").tflops == 4.0


def test_every_key_column_separates_rows(empty_data_dir):
    base = row("01_naive")
    variants = [base, row("02_coalesced"), row("01_naive", gpu="Other GPU"), row("01_naive", N=2048),
                row("01_naive", D=128), row("01_naive", dtype="fp16"), row("01_naive", causal=True),
                dict(base, B=8), dict(base, H=8)]
    results.upsert(variants)
    df = results.load()
    assert len(df) == len(variants)
    assert set(df["gpu"]) == {"NVIDIA Test GPU", "Other GPU"}
    results.upsert([row("01_naive", gpu="Other GPU", tflops=9.0)])
    df = results.load()
    assert len(df) == len(variants)
    assert one(df, stage="01_naive", gpu="Other GPU").tflops == 9.0
    assert one(df[(df["N"] == 1024) & (df["D"] == 64) & (df["dtype"] == "fp32") & ~df["causal"]
                  & (df["B"] == 4) & (df["H"] == 16)], stage="01_naive", gpu="NVIDIA Test GPU").tflops == 1.0


def test_contract_columns_come_first_in_order(empty_data_dir):
    assert results.contract == ["stage", "dtype", "B", "H", "N", "D", "causal", "median_ms",
                                "tflops", "rel_err", "gpu", "pass", "gpus"]
    assert results.columns[:len(results.contract)] == results.contract
    assert set(results.key) <= set(results.contract)
    table = results.upsert([row("01_naive")])
    assert list(table.columns[:len(results.contract)]) == results.contract
    with open(results.path(), newline="") as f:
        header = next(csv.reader(f))
    assert header[:len(results.contract)] == results.contract
    assert header == results.columns


def test_extra_columns_are_kept(empty_data_dir):
    results.upsert([row("01_naive", my_extra="x")])
    df = results.load()
    assert list(df.columns[:len(results.columns)]) == results.columns
    assert one(df, stage="01_naive").my_extra == "x"


def test_sdpa_percentages(empty_data_dir):
    results.upsert([row("01_naive", tflops=50.0), row("sdpa_flash", tflops=100.0),
                    row("sdpa_cudnn", tflops=200.0), row("sdpa_math", tflops=10.0),
                    row("torch_naive", tflops=400.0),  # not SDPA: never the reference
                    # the same key but fp16: must not count for the fp32 rows
                    row("sdpa_flash", dtype="fp16", tflops=1000.0),
                    # no SDPA row at N=2048
                    row("01_naive", N=2048, tflops=40.0)])
    df = results.load()
    r = one(df, stage="01_naive", N=1024)
    assert r.pct_sdpa_flash == pytest.approx(50.0)
    assert r.pct_sdpa_best == pytest.approx(25.0)
    assert one(df, stage="sdpa_flash", dtype="fp32").pct_sdpa_flash == pytest.approx(100.0)
    assert one(df, stage="sdpa_cudnn").pct_sdpa_best == pytest.approx(100.0)
    assert one(df, stage="torch_naive").pct_sdpa_best == pytest.approx(200.0)
    r = one(df, stage="01_naive", N=2048)
    assert math.isnan(r.pct_sdpa_flash) and math.isnan(r.pct_sdpa_best)
    r = one(df, stage="sdpa_flash", dtype="fp16")
    assert r.pct_sdpa_flash == pytest.approx(100.0) and r.pct_sdpa_best == pytest.approx(100.0)


def test_percentages_follow_a_new_baseline(empty_data_dir):
    results.upsert([row("03_coarsened", tflops=30.0)])
    assert math.isnan(one(results.load(), stage="03_coarsened").pct_sdpa_best)
    results.upsert([row("sdpa_efficient", tflops=60.0)])
    assert one(results.load(), stage="03_coarsened").pct_sdpa_best == pytest.approx(50.0)
    assert math.isnan(one(results.load(), stage="03_coarsened").pct_sdpa_flash)
    results.upsert([row("sdpa_efficient", tflops=120.0)])
    assert one(results.load(), stage="03_coarsened").pct_sdpa_best == pytest.approx(25.0)


def test_failed_sdpa_rows_are_not_a_reference(empty_data_dir):
    results.upsert([row("01_naive", tflops=10.0), row("sdpa_flash", tflops=20.0),
                    row("sdpa_cudnn", tflops=1000.0, status="failed check")])
    r = one(results.load(), stage="01_naive")
    assert r.pct_sdpa_flash == pytest.approx(50.0) and r.pct_sdpa_best == pytest.approx(50.0)


def test_rows_without_timings(empty_data_dir):
    table = results.upsert([error_row("02_coalesced")])  # the very first write: no timings at all
    assert len(table) == 1
    results.upsert([row("01_naive", tflops=1.0), row("sdpa_flash", tflops=4.0),
                    error_row("03_coarsened"),
                    row("04_failed", status="failed check", tflops=float("nan"), median_ms=float("nan"),
                        note="not timed: check failed")])
    df = results.load()
    assert len(df) == 5
    for stage in ("02_coalesced", "03_coarsened", "04_failed"):
        r = one(df, stage=stage)
        assert math.isnan(r.tflops) and math.isnan(r.pct_sdpa_best) and math.isnan(r.pct_sdpa_flash)
    assert one(df, stage="03_coarsened").status == "error"
    assert one(df, stage="01_naive").pct_sdpa_flash == pytest.approx(25.0)
    # an error later replaces the timed row with the same key
    results.upsert([error_row("01_naive")])
    r = one(results.load(), stage="01_naive")
    assert r.status == "error" and math.isnan(r.tflops)


def test_upsert_nothing(empty_data_dir):
    assert results.upsert([]).empty
    assert not results.path().exists()
    results.upsert([row("01_naive")])
    assert len(results.upsert(pd.DataFrame())) == 1


def test_upsert_accepts_a_dataframe_and_normalises_types(empty_data_dir):
    results.upsert(pd.DataFrame([row("01_naive", causal="True"), row("01_naive", causal=0, N=2048)]))
    df = results.load()
    assert df["causal"].dtype == bool
    assert list(df.sort_values("N")["causal"]) == [True, False]
    for col in results.ints:
        assert df[col].dtype == "int64"


def test_written_file_is_plain_csv(empty_data_dir):
    rows = [row("01_naive", tflops=1.5), row("sdpa_flash", tflops=3.0, note='a "quoted", note'),
            error_row("02_coalesced")]
    results.upsert(rows)
    p = results.path()
    df = pd.read_csv(p)
    assert list(df.columns) == results.columns
    assert len(df) == 3
    assert set(df["stage"]) == {"01_naive", "sdpa_flash", "02_coalesced"}
    assert df.loc[df["stage"] == "01_naive", "pct_sdpa_flash"].iloc[0] == pytest.approx(50.0)
    with open(p, newline="") as f:
        records = list(csv.DictReader(f))
    assert len(records) == 3
    by = {r["stage"]: r for r in records}
    assert float(by["01_naive"]["tflops"]) == 1.5
    assert by["01_naive"]["causal"] == "False"
    assert by["sdpa_flash"]["note"] == 'a "quoted", note'
    assert by["02_coalesced"]["tflops"] == ""
    assert oct(os.stat(p).st_mode & 0o777) == oct(0o644)


def test_the_recorded_table_loads(data_dir):
    df = results.load()
    assert len(df) > 0
    assert list(df.columns[:len(results.contract)]) == results.contract
    assert not df.duplicated(results.key).any()
    assert set(df["status"].dropna()) <= {"ok", "failed check", "error", "unsupported"}


# --- atomicity -----------------------------------------------------------------------------------

def _leftovers(d):
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_a_failed_rename_leaves_the_old_table(empty_data_dir, monkeypatch):
    results.upsert([row("01_naive")])
    before = results.path().read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk went away")

    with monkeypatch.context() as m:  # (monkeypatch.undo() would also undo FLASHLAB_DATA)
        m.setattr(os, "replace", broken_replace)
        with pytest.raises(OSError, match="disk went away"):
            results.upsert([row("02_coalesced"), row("01_naive", tflops=99.0)])
    assert results.path().read_bytes() == before
    assert _leftovers(empty_data_dir) == []
    # the lock was released: the next write goes through
    results.upsert([row("02_coalesced")])
    assert len(results.load()) == 2


def test_a_write_killed_halfway_leaves_the_old_table(empty_data_dir, monkeypatch):
    results.upsert([row("01_naive"), row("sdpa_flash")])
    before = results.path().read_bytes()
    real_to_csv = pd.DataFrame.to_csv

    def half_then_die(self, f, *args, **kwargs):
        text = real_to_csv(self, None, *args, **kwargs)
        f.write(text[: len(text) // 2])
        f.flush()
        raise KeyboardInterrupt  # a BaseException, like a Ctrl-C in a notebook

    with monkeypatch.context() as m:
        m.setattr(pd.DataFrame, "to_csv", half_then_die)
        with pytest.raises(KeyboardInterrupt):
            results.upsert([row("03_coarsened")])
    assert results.path().read_bytes() == before
    assert _leftovers(empty_data_dir) == []
    assert len(results.load()) == 2


def test_side_tables_are_written_the_same_way(empty_data_dir, monkeypatch):
    side = tables.Table("side.csv", key=["stage", "N", "causal"],
                        columns=["stage", "N", "causal", "rel_err"], ints=["N"], bools=["causal"],
                        floats=["rel_err"])
    p = side.path()
    side.upsert([dict(stage="01_naive", N=1, causal=False, rel_err=0.1),
                 dict(stage="01_naive", N=2, causal=True, rel_err=0.2)])
    side.upsert([dict(stage="01_naive", N=1, causal=False, rel_err=0.3)])
    df = pd.read_csv(p)
    assert len(df) == 2 and df.set_index("N").loc[1, "rel_err"] == 0.3
    before = p.read_bytes()

    def broken_replace(src, dst):
        raise OSError("no")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", broken_replace)
        with pytest.raises(OSError):
            side.upsert([dict(stage="01_naive", N=3, causal=False, rel_err=0.3)])
    assert p.read_bytes() == before and _leftovers(empty_data_dir) == []


# --- several processes at once --------------------------------------------------------------------

WRITERS = 4
ROWS_EACH = 4


def _writer(table_path, i):
    """Runs in a spawned process: upsert ROWS_EACH rows of its own, one write each."""
    from flashlab.tables import RESULTS as res
    for j in range(ROWS_EACH):
        res.upsert([row(f"{i:02d}_writer", N=512 * (j + 1), tflops=float(i * 100 + j))], table_path)
    return i


def test_concurrent_writers_lose_nothing(empty_data_dir):
    p = empty_data_dir / "results.csv"
    results.upsert([row("00_existing")], p)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(WRITERS) as pool:
        done = pool.starmap(_writer, [(str(p), i) for i in range(1, WRITERS + 1)])
    assert sorted(done) == list(range(1, WRITERS + 1))
    df = pd.read_csv(p)
    assert len(df) == 1 + WRITERS * ROWS_EACH
    assert not df.duplicated(results.key).any()
    for i in range(1, WRITERS + 1):
        mine = df[df["stage"] == f"{i:02d}_writer"].sort_values("N")
        assert list(mine["tflops"]) == [float(i * 100 + j) for j in range(ROWS_EACH)]
    assert _leftovers(empty_data_dir) == []


# --- every table --------------------------------------------------------------------------------

def test_every_recorded_table_loads_with_its_types(data_dir):
    """Each CSV of data/ has one owner and one set of types: its key columns unique, its ints
    ints, its flags bools, whatever wrote it."""
    for table in tables.ALL:
        df = table.load()
        assert len(df), f"{table.name} is empty"
        assert list(df.columns[:len(table.columns)]) == table.columns, table.name
        assert not df.duplicated(table.key).any(), table.name
        for col in table.ints:
            assert df[col].dtype == "int64", (table.name, col)
        for col in table.bools:
            assert df[col].dtype == bool, (table.name, col)


def test_replace_drops_a_slice_before_writing(empty_data_dir):
    t = tables.SASS
    base = dict(kernel="k", category="HMMA", count=1, source_hash="h", nvcc="13", cuobjdump="13",
                commit="c")
    t.upsert([dict(stage="01_naive", arch="sm_80", **base), dict(stage="02_coalesced", arch="sm_80", **base)])
    t.upsert([dict(stage="01_naive", arch="sm_80", **{**base, "kernel": "renamed"})],
             replace={"arch": "sm_80", "stage": ["01_naive"]})
    df = t.load()
    assert sorted(zip(df["stage"], df["kernel"])) == [("01_naive", "renamed"), ("02_coalesced", "k")]


def test_no_module_but_tables_opens_a_recorded_csv():
    """One owner: no other module of the package names a recorded CSV's file."""
    from flashlab import paths
    names = [t.name for t in tables.ALL]
    for py in sorted((paths.ROOT / "flashlab").rglob("*.py")):
        if py.name == "tables.py":
            continue
        code = "\n".join(line for line in py.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        for name in names:
            for quote in ('"', "'"):
                assert f"{quote}{name}{quote}" not in code, f"{py.name} names {name}"


def test_nothing_recorded_comes_from_a_dirty_tree():
    """Recorded numbers name the commit that made them; a '-dirty' one names no code anyone can
    check out."""
    from flashlab import tables
    for table in tables.ALL:
        df = table.load()
        if "commit" in df:
            dirty = df[df["commit"].astype(str).str.endswith("-dirty")]
            assert dirty.empty, f"{table.name}: {len(dirty)} rows from a dirty tree"


def test_a_run_that_recorded_rows_without_registers_says_so_and_fails():
    """`flashlab run` ends with a line naming the stages whose rows it recorded without a ptxas
    report (and counts as failed); rows recorded before it started, baselines and rows that did
    not run are not its business."""
    from flashlab.runner import unreported_registers
    start = "2026-11-27T14:41:20Z"
    nan = float("nan")
    df = pd.DataFrame([  # stage, kind, status, registers, time
        ("09_wgmma", "stage", "ok", nan, "2026-11-27T14:41:58Z"),
        ("09_wgmma", "stage", "ok", 122.0, "2026-11-27T14:42:00Z"),
        ("10_tma", "stage", "ok", nan, "2026-11-27T12:21:23Z"),  # before the run
        ("11_warpspec", "stage", "failed check", nan, "2026-11-27T14:43:00Z"),
        ("sdpa_cudnn", "sdpa", "ok", nan, "2026-11-27T14:44:00Z"),
    ], columns=["stage", "kind", "status", "registers", "time"])
    assert list(tables.since(df, start)["time"]) == [t for t in df["time"] if t >= start]
    line = unreported_registers(df, start)
    assert line.startswith("no ptxas report: 1 rows of 09_wgmma")
    assert "10_tma" not in line and "11_warpspec" not in line and "sdpa" not in line
    assert unreported_registers(df[df["registers"].notna() | (df["kind"] != "stage")], start) == ""


def test_a_cache_file_is_written_whole_and_leaves_no_temporary_file(tmp_path):
    """paths.write_atomic (the ptxas and sass caches) replaces the file in one step."""
    from flashlab import paths
    target = tmp_path / "cache" / "09_wgmma-sm_90a-abc.json"
    paths.write_atomic(target, "[1, 2]")
    paths.write_atomic(target, "[3]")
    assert target.read_text() == "[3]"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_sweep_runs_tell_rows_timed_in_one_run_from_rows_of_two(empty_data_dir):
    """A run's rows share a time stamp: stages recorded together have one stamp, a stage a later
    run re-recorded has another, and a comparison of the two is not of rows timed in turn."""
    first, later = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"
    results.upsert([row(s, N=512, B=32, H=32, dtype="fp16", time=first, **{"pass": "backward"})
                    for s in ("20_warpspec_backward", "21_deterministic_hopper", "sdpa_cudnn")])
    results.upsert([row(s, N=512, B=32, H=32, dtype="fp16", time=later, **{"pass": "backward"})
                    for s in ("20_warpspec_backward", "sdpa_cudnn")])
    runs = tables.sweep_runs(["20_warpspec_backward", "21_deterministic_hopper", "sdpa_cudnn"],
                             gpu="NVIDIA Test GPU", pass_="backward")
    assert runs == {"20_warpspec_backward": [later], "21_deterministic_hopper": [first],
                    "sdpa_cudnn": [later]}
    assert tables.sweep_runs(["20_warpspec_backward"], gpu="NVIDIA Test GPU") == {
        "20_warpspec_backward": []}  # no forward rows
