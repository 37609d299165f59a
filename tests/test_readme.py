"""The README's stage table is generated from data/results.csv and must match it."""
import flashlab as fl
from flashlab import cli, readme


def test_readme_table_matches_recorded_results():
    text = readme.README.read_text()
    assert readme.render(text, readme.stage_table()) == text, \
        "README.md is out of date: run flashlab readme"


def test_readme_gives_the_test_command_ci_runs():
    """The README's test command is the line .ci/run runs, word for word."""
    command = "python -m pytest -q -n auto --maxprocesses=4"
    ci = (readme.paths.ROOT / ".ci" / "run").read_text()
    assert f"```bash\n{command}\n```" in readme.README.read_text()
    assert f"\n{command}\n" in ci


def test_table_lists_every_recorded_stage():
    """Every stage with rows at the teaching config has a row in README's stage table."""
    from flashlab import tables
    df = tables.RESULTS.load()
    gpu = tables.gpu_shown(df=df)
    table = readme.stage_table()
    recorded = [st for st in fl.stages() if len(tables.stage_at_teaching(tables.ok(tables.on_gpu(df, gpu)), st))]
    assert len(recorded) >= 13
    rows = [ln for ln in table.splitlines() if ln.startswith("|")]
    for st in recorded:
        assert any(f"{st.slug}" in ln for ln in rows), (st.slug, table)



def test_readme_sweep_table_matches_recorded_results():
    text = readme.README.read_text()
    assert readme.render(text, readme.sweep_table(), readme.SWEEP_START, readme.SWEEP_END) == text, \
        "README.md's sweep table is out of date: run flashlab readme"
    assert cli.main(["readme", "--check"]) == 0


def test_the_command_list_exists_once():
    """README's command list is the CLI's own, and the CLI's help shows it."""
    text = readme.README.read_text()
    block = readme.commands_block(cli.command_list())
    assert f"{readme.COMMANDS_START}\n{block}\n{readme.COMMANDS_END}" in text
    assert cli.command_list() in cli.parser().description
    commands = {usage.split()[1] for usage, _ in cli.COMMANDS}
    assert commands == set(next(a for a in cli.parser()._actions if hasattr(a, "choices")
                                and isinstance(a.choices, dict)).choices)


def _sweep_rows(stage, tflops, commit):
    import pandas as pd
    return pd.DataFrame([dict(stage=stage, dtype="fp16", B=16384 // n, H=2048 // d, N=n, D=d,
                              causal=c, tflops=tflops, status="ok", gpu="Some GPU", commit=commit,
                              time="2030-01-01T00:00:00Z")
                         for d in (64, 128) for c in (False, True) for n in (512, 1024)])


def test_sweep_table_on_synthetic_rows():
    import pandas as pd
    from flashlab.stages import fastest_forward
    last = fastest_forward().slug
    df = pd.concat([_sweep_rows(last, 330.0, "abc"), _sweep_rows("sdpa_flash", 300.0, "abc"),
                    _sweep_rows("sdpa_cudnn", 400.0, "abc")])
    table = readme.sweep_table(df)
    assert "| D = 128, causal | 1.10× | 1.10× |" in table and "| D = 64 | 0.82× | 0.82× |" in table
    assert "in the same run, commit `abc`" in table and "worst 1.10×" in table
    assert f"{last} ÷ sdpa_flash" in table and f"{last} ÷ sdpa_cudnn" in table
    apart = pd.concat([_sweep_rows(last, 270.0, "new"), _sweep_rows("sdpa_flash", 300.0, "old")])
    table = readme.sweep_table(apart)
    assert f"{last} at commit `new`, sdpa_flash at `old`" in table and "0.90×" in table
    assert "sdpa_cudnn has not been measured" in table
    assert "not been measured" in readme.sweep_table(_sweep_rows("sdpa_flash", 300.0, "x"))
