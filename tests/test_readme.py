"""The README's stage table is generated from data/results.csv and must match it."""
from flashlab import readme


def test_readme_table_matches_recorded_results():
    text = readme.README.read_text()
    assert readme.render(text, readme.stage_table()) == text, \
        "README.md is out of date: run python -m flashlab.readme"


def test_readme_gives_the_test_command_ci_runs():
    ci = (readme.paths.ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in readme.README.read_text()
    assert "python -m pytest -q" in ci


def test_table_lists_every_recorded_stage():
    table = readme.stage_table()
    for slug in ("01_naive", "02_coalesced", "03_coarsened"):
        assert slug in table

