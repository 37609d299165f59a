"""`flashlab report` and the profile figures, against a temporary copy of data/ — with the
synthetic profile.csv of tests/synthetic_profile.py where a test needs Nsight Compute data."""
import base64
import io
import os
import re
import subprocess
import sys

import matplotlib
import pytest

matplotlib.use("Agg")

from matplotlib.text import Text  # noqa: E402

import synthetic_profile  # noqa: E402
from flashlab import cli, paths, plots, profile_schema, report, tables  # noqa: E402
from flashlab.tables import RESULTS as results  # noqa: E402
from flashlab.stages import stages  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
IMG = re.compile(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"')
MD_IMG = re.compile(r"!\[[^\]]*\]\(([^)]+\.png)\)")
MD_LINK = re.compile(r"\]\(([^)]+\.ipynb)\)")


@pytest.fixture
def profiled(data_dir):
    """The copy of data/ plus a synthetic profile.csv on the GPU its results come from."""
    synthetic_profile.write(data_dir, tables.gpu_shown())
    return data_dir


@pytest.fixture
def unprofiled(data_dir):
    """The copy of data/ without any Nsight Compute data (as on a checkout before a profile)."""
    (data_dir / "profile.csv").unlink(missing_ok=True)
    return data_dir


def words(fig):
    """Every piece of text a figure shows, once drawn (titles, labels, annotations, table cells)."""
    fig.savefig(io.BytesIO(), format="png")
    cells = [c.get_text() for ax in fig.axes for t in ax.tables for c in t.get_celld().values()]
    return [t.get_text() for t in fig.findobj(Text) + cells if t.get_text()]


def n_figures(with_profile, profiled=None):
    """profiled: the stages the profile holds (default: all); one "what changed" panel for each
    of them after the first stage."""
    later = len([st for st in stages()[1:] if profiled is None or st.slug in profiled])
    return len(plots.FIGURES) + (len(plots.PROFILE_FIGURES) + later if with_profile else 0)


def test_synthetic_profile_follows_the_schema():
    df = synthetic_profile.rows("Some GPU")
    assert list(df.columns) == profile_schema.COLUMNS
    known = set(profile_schema.METRICS) | {f"stall_{r}" for r in profile_schema.STALL_REASONS}
    assert set(df["metric"]) <= known
    assert not df.duplicated(profile_schema.KEY).any()


# --- the page ---

def check_html(text, n_images):
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    recorded = results.load()
    gpu = tables.gpu_shown()
    assert "<table>" in text and "</table>" in text
    for st in stages():
        assert f"<b>{st.slug}</b>" in text
    rows = recorded[recorded["gpu"] == gpu]
    for value in (gpu, rows["torch"].iloc[0], rows["cuda"].iloc[0], rows["commit"].iloc[0]):
        assert str(value) in text
    images = IMG.findall(text)
    assert len(images) == n_images
    for data in images:
        assert base64.b64decode(data).startswith(PNG)
    # self-contained: nothing to fetch, so it opens offline
    assert not re.findall(r'src="(?!data:image/png;base64,)', text)
    assert "href=" not in text and "<link" not in text and "<script" not in text


def test_html_report_from_recorded_results(unprofiled, tmp_path):
    out = report.write(tmp_path / "handout.html")
    text = out.read_text(encoding="utf-8")
    check_html(text, n_figures(with_profile=False))
    assert "Nsight Compute" not in text  # no profile recorded: no profile section


def test_html_report_with_a_profile(profiled, tmp_path):
    text = report.write(tmp_path / "handout.html").read_text(encoding="utf-8")
    check_html(text, n_figures(with_profile=True))
    assert "Inside the kernels (Nsight Compute)" in text
    assert synthetic_profile.rows("x")["commit"].iloc[0] in text  # the profile's provenance


def test_markdown_report_references_the_pngs_it_wrote(profiled, tmp_path):
    out = report.write(tmp_path / "handout" / "page.md")
    text = out.read_text(encoding="utf-8")
    pngs = MD_IMG.findall(text)
    assert len(pngs) == n_figures(with_profile=True)
    for ref in pngs:
        assert not os.path.isabs(ref)
        target = out.parent / ref
        assert target.is_file() and target.read_bytes().startswith(PNG), ref
    for st in stages():
        assert f"[**{st.slug}**](" in text
    for ref in MD_LINK.findall(text):  # the stage names link to their notebooks
        assert (out.parent / ref).resolve() == paths.NOTEBOOKS / os.path.basename(ref)
    assert "data:image" not in text


@pytest.mark.slow
def test_cli_writes_data_report_by_default(data_dir, capsys):
    assert cli.main(["report"]) == 0
    assert capsys.readouterr().out.strip() == str(data_dir / "report.html")
    assert (data_dir / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert cli.main(["report", "--format", "md"]) == 0
    assert (data_dir / "report.md").is_file() and (data_dir / "report_figures").is_dir()


@pytest.mark.slow
def test_format_follows_the_suffix(data_dir, tmp_path):
    assert report.write(tmp_path / "a.md").read_text(encoding="utf-8").startswith("# ")
    forced = report.write(tmp_path / "b.md", fmt="html")
    assert forced.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_report_with_nothing_recorded(empty_data_dir, tmp_path):
    text = report.write(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "No results recorded yet" in text and "<img" not in text
    md = report.write(tmp_path / "r.md").read_text(encoding="utf-8")
    assert "No results recorded yet" in md and not MD_IMG.findall(md)


def test_report_help_exits_0(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(paths.ROOT), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, "-m", "flashlab", "report", "--help"], cwd=paths.ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: flashlab report") and "--format" in proc.stdout


# --- the profile figures ---

def test_profile_figures_without_a_profile(unprofiled):
    assert not (unprofiled / "profile.csv").exists()
    for fig in (plots.idea_metrics(), plots.stalls()):
        assert any(plots.NO_PROFILE in w for w in words(fig))
    panel = words(plots.stage_panel(3))
    assert any(plots.NO_PROFILE in w for w in panel)
    assert "TFLOP/s" in panel and "02_coalesced" in panel  # results.csv's half still shows


def test_save_all_with_and_without_a_profile(unprofiled, tmp_path):
    names = lambda written: sorted(p.name for p in written)
    assert names(plots.save_all(outdir=tmp_path / "a")) == sorted(f"{n}.png" for n in plots.FIGURES)
    synthetic_profile.write(unprofiled, tables.gpu_shown())
    written = plots.save_all(outdir=tmp_path / "b")
    assert len(written) == n_figures(with_profile=True)
    assert {"idea_metrics.png", "stalls.png", "stage_03_coarsened.png"} <= set(names(written))
    for p in written:
        assert p.read_bytes().startswith(PNG)


def test_idea_metrics_annotates_the_factor(profiled):
    shown = words(plots.idea_metrics())
    sectors = synthetic_profile.INVENTED["global_load_sectors_per_request"]
    assert f"{sectors[0] / sectors[1]:.1f}x fewer" in shown  # 01 -> 02
    occupancy = synthetic_profile.INVENTED["achieved_occupancy_pct"]
    assert f"{occupancy[1] / occupancy[2]:.1f}x lower" in shown  # 02 -> 03
    assert "none left" in shown  # the synthetic 03 has no bank conflicts, even on a log axis
    assert not any("1,000,000,000" in w for w in shown)  # the decoy rows (other N, a baseline)


def test_stalls_stack_every_reason(profiled):
    fig = plots.stalls()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [st.slug for st in stages()]
    reasons = {k: v for k, v in synthetic_profile.INVENTED.items() if k.startswith("stall_")}
    for i, st in enumerate(stages()):
        bars = [b for b in ax.patches if abs(b.get_y() + b.get_height() / 2 - i) < 1e-9]
        total = sum(v[min(i, len(v) - 1)] for v in reasons.values())
        assert sum(b.get_width() for b in bars) == pytest.approx(total)


def test_stage_panel_shows_both_stages(profiled):
    shown = words(plots.stage_panel("03_coarsened"))
    assert "02_coalesced" in shown and "03_coarsened" in shown
    assert any("bank conflicts" in w for w in shown)
    assert "none left" in shown
    assert sum(w.startswith("stall: ") for w in shown) == 3  # the stage's top 3 stall reasons
    first = words(plots.stage_panel(1))  # nothing before it: still draws
    assert "(first stage)" in first


def test_profile_of_another_gpu_is_not_shown(data_dir):
    synthetic_profile.rows("Some other GPU").to_csv(data_dir / "profile.csv", index=False)
    assert list(plots.drawings()) == list(plots.FIGURES)
    gpu = tables.gpu_shown()
    assert any(plots.NO_PROFILE in w for w in words(plots.idea_metrics(gpu=gpu)))
    # one view, one GPU: the GPU shown, never the latest GPU profiled instead
    assert any(plots.NO_PROFILE in w for w in words(plots.idea_metrics()))
    assert "Some other GPU" in " ".join(words(plots.idea_metrics(gpu="Some other GPU")))


def test_profile_as_a_dataframe(empty_data_dir):
    df = synthetic_profile.rows("Some GPU")
    df["causal"] = df["causal"].astype(str)  # as read back from CSV text
    assert "Some GPU" in " ".join(words(plots.stalls(profile=df, gpu="Some GPU")))


def test_the_recorded_profile_draws_every_figure(data_dir, tmp_path):
    """data/ as committed: if it holds a profile, every profile figure comes from it."""
    if not (data_dir / "profile.csv").exists():
        pytest.skip("no profile recorded in data/ yet")
    written = plots.save_all(outdir=tmp_path)
    profiled = set(plots.profile_rows()[0]["stage"])  # a stage added since the last run has none
    assert len(written) == n_figures(with_profile=True, profiled=profiled)
    for fig in (plots.idea_metrics(), plots.stalls()):
        assert not any(plots.NO_PROFILE in w for w in words(fig))


def test_profile_figures_for_some_stages(profiled):
    """`only` keeps the transitions into (idea_metrics) or the rows of (stalls) the given stages:
    what one notebook shows."""
    fig = plots.idea_metrics(only=["07_cp_async"])
    titles = [sub._suptitle.get_text() for sub in fig.subfigs]
    assert len(titles) == 1 and titles[0].startswith("06_swizzle → 07_cp_async")
    ax = plots.stalls(only=["06_swizzle", "07_cp_async"]).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["06_swizzle", "07_cp_async"]


def test_profile_figures_for_stages_not_profiled(unprofiled):
    for fig in (plots.idea_metrics(only=["06_swizzle"]), plots.stalls(only=["06_swizzle"])):
        assert any("06_swizzle" in w and plots.NO_PROFILE in w for w in words(fig))


# --- each notebook's questions for discussion ---

def notebook(path, *cells):
    """A notebook of markdown cells (and one code cell between them), written with nbformat."""
    import nbformat
    from nbformat import v4
    nb = v4.new_notebook()
    nb.cells = [v4.new_markdown_cell(cells[0]), v4.new_code_cell("x = 1")]
    nb.cells += [v4.new_markdown_cell(c) for c in cells[1:]]
    nbformat.write(nb, str(path))


@pytest.fixture
def notebooks(tmp_path, monkeypatch):
    """Two notebooks that end with questions (one with `code` and a continued item), one
    without any: report.NOTEBOOKS points at them."""
    d = tmp_path / "notebooks"
    d.mkdir()
    notebook(d / "01_first.ipynb", "# Stage 01 — the first idea\n\nIntro.",
             "## Summary\n\n- learned",
             "## Questions for discussion\n\n1. Why is `k` read N times?\n"
             "2. What would **halve** the traffic,\n   and what would it cost?\n")
    notebook(d / "02_second.ipynb", "# 02 · The second idea", "### Discussion\n\nMeasured.",
             "## Questions for discussion\n1. Is 3 < 4 & 5 > 2 here?")
    notebook(d / "03_silent.ipynb", "# 03 · No questions", "## Summary\n\n- nothing to ask")
    (d / "scratch.ipynb").write_text("not a stage notebook")  # not NN_*.ipynb: never read
    monkeypatch.setattr(report, "NOTEBOOKS", d)
    return d


def test_questions_read_from_the_notebooks(notebooks):
    asked = report.questions()
    assert [title for title, _ in asked] == ["Stage 01 — the first idea", "02 · The second idea"]
    assert asked[0][1] == ("1. Why is `k` read N times?\n"
                           "2. What would **halve** the traffic,\n   and what would it cost?")
    assert report.questions(notebooks / "nowhere") == []


def test_html_report_has_the_questions(unprofiled, notebooks, tmp_path):
    text = report.write(tmp_path / "handout.html").read_text(encoding="utf-8")
    section = text[text.index("<h2>Questions for discussion</h2>"):]
    assert section.index("<h3>Stage 01 — the first idea</h3>") < section.index("<h3>02 · The second idea</h3>")
    assert "<li>Why is <code>k</code> read N times?</li>" in section
    assert "<li>What would <b>halve</b> the traffic, and what would it cost?</li>" in section
    assert "<li>Is 3 &lt; 4 &amp; 5 &gt; 2 here?</li>" in section
    assert "No questions" not in text and "nothing to ask" not in text
    check_html(text, n_figures(with_profile=False))  # still one self-contained page


def test_markdown_report_has_the_questions(unprofiled, notebooks, tmp_path):
    text = report.write(tmp_path / "handout.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Questions for discussion\n"):]
    assert "### Stage 01 — the first idea\n\n1. Why is `k` read N times?\n" in section
    assert "2. What would **halve** the traffic,\n   and what would it cost?" in section
    assert "### 02 · The second idea\n\n1. Is 3 < 4 & 5 > 2 here?" in section
    assert "No questions" not in text


def test_no_questions_no_section(unprofiled, tmp_path, monkeypatch):
    monkeypatch.setattr(report, "NOTEBOOKS", tmp_path / "empty")
    assert "Questions for discussion" not in report.write(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "Questions for discussion" not in report.write(tmp_path / "r.md").read_text(encoding="utf-8")
