"""The figures as a slide shows them, drawn without a GPU from the recorded data (a temporary copy
of data/) or from small synthetic tables: labels that never overlap, titles that name what they
plot, a layout that fits a slide, counts that do not mislead, and no spoilers (last=)."""
import matplotlib
import pandas as pd
import pytest

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.legend import Legend  # noqa: E402
from matplotlib.text import Annotation, Text  # noqa: E402

import synthetic_profile  # noqa: E402
from flashlab import plots, tables  # noqa: E402
from flashlab.configs import teaching  # noqa: E402
from flashlab.stages import stage, stages  # noqa: E402

GPU = "Some GPU"


def drawn(fig):
    """The figure drawn on an Agg canvas, and its renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def result(name, dtype, tflops, gpu=GPU):
    cfg = teaching(dtype)
    return dict(stage=name, kind="baseline" if name in plots.BASELINE_STYLE else "stage",
                dtype=dtype, B=cfg.B, H=cfg.H, N=cfg.N, D=cfg.D, causal=False, gpu=gpu,
                status="ok", tflops=tflops, median_ms=cfg.flops / tflops / 1e9, rel_err=1e-7,
                compute_capability="9.0", torch="2.0", cuda="12.0", commit="abc",
                time="2030-01-01T00:00:00Z")


def crowded():
    """Every stage in both teaching dtypes at nearly the same speed, and every baseline among
    them: the labels' worst case."""
    rows = [result(st.slug, dtype, base * (1 + 0.01 * i))
            for dtype, base in (("fp32", 30.0), ("fp16", 170.0)) for i, st in enumerate(stages())]
    rows += [result(name, dtype, base * 1.02) for dtype, base in (("fp32", 30.0), ("fp16", 170.0))
             for name in plots.BASELINE_STYLE]
    return pd.DataFrame(rows)


def assert_labels_apart(fig):
    """No two stage labels' text boxes meet, and none meets a legend."""
    renderer = drawn(fig)
    ax = fig.axes[0]
    labels = [a for a in ax.texts if isinstance(a, Annotation)]
    boxes = [Text.get_window_extent(a, renderer) for a in labels]  # the text, not its leader line
    for i, a in enumerate(boxes):
        for j in range(i):
            assert not a.overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())
    legends = [leg.get_window_extent(renderer) for leg in fig.findobj(Legend)]
    assert legends
    for label, box in zip(labels, boxes):
        assert not any(box.overlaps(leg) for leg in legends), label.get_text()
        assert ax.bbox.contains(box.x0, box.y0) and ax.bbox.contains(box.x1, box.y1), label.get_text()
    return [a.get_text() for a in labels]


def recorded_stages() -> list:
    """The stages data/ holds rows of on the GPU the figures show, in order (a stage added since
    has none until it is run there; one measured alone on another GPU shows in its own view)."""
    recorded = set(tables.on_gpu(tables.RESULTS.load(), tables.gpu_shown())["stage"])
    return [st.slug for st in stages() if st.slug in recorded]


# --- 1. the roofline's labels ---

def test_roofline_labels_apart_on_the_recorded_data(data_dir):
    texts = assert_labels_apart(plots.roofline())
    assert len(texts) == len(recorded_stages()) >= 13
    assert "05_mma (fp16)" in texts


def test_roofline_labels_apart_when_crowded():
    fig = plots.roofline(crowded(), gpu=GPU, ceilings={"copy_tbps": 3.0, "matmul_fp16_tflops": 760.0,
                                                        "matmul_fp32_tflops": 52.0})
    texts = assert_labels_apart(fig)
    assert len(texts) == 2 * len(stages())


def test_roofline_labels_apart_without_ceilings():
    assert len(assert_labels_apart(plots.roofline(crowded(), gpu=GPU, ceilings={}))) == 2 * len(stages())


def test_spread_keeps_the_gap_and_the_bounds():
    ys = plots._spread([5, 5, 5, 6, 50, 99, 100], gap=10, lo=0, hi=100)
    assert all(b - a >= 10 - 1e-9 for a, b in zip(ys, ys[1:]))
    assert ys[0] >= 0 and ys[-1] <= 100
    assert ys[4] == 50  # a label with room stays at its point
    assert plots._spread([20, 40], gap=10, lo=0, hi=100) == [20, 40]


# --- 2. the ladder's title ---

@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_ladder_title_names_its_dtype(data_dir, dtype):
    title = plots.ladder(dtype=dtype).axes[0].get_title().splitlines()[0]
    assert dtype in title
    assert not any(other in title for other in ("fp32", "fp16", "bf16") if other != dtype)


# --- 3. the idea-metric figure fits a slide ---

def test_idea_metrics_is_a_grid_that_fits_a_slide(data_dir):
    synthetic_profile.write(data_dir, tables.gpu_shown())
    fig = plots.idea_metrics()
    renderer = drawn(fig)
    width, height = fig.canvas.get_width_height()
    assert width / height <= 3
    assert 10 <= fig.get_figwidth() <= 14
    with_metrics = [st for st in stages()[1:] if st.idea_metrics]
    assert len(fig.subfigs) == len(with_metrics)
    # at most PANELS_PER_ROW panels side by side: the axes' left edges take that many places
    rows = {}
    for ax in fig.axes:
        rows.setdefault(round(ax.get_window_extent(renderer).y1), []).append(ax)
    assert max(len(r) for r in rows.values()) <= plots.PANELS_PER_ROW
    assert len(rows) > 1
    small = {t.get_text(): t.get_fontsize() for t in fig.findobj(Text)
             if t.get_text() and t.get_visible() and t.get_fontsize() < 9}
    assert not small
    for sub in fig.subfigs:  # each transition's title stays inside its own panels' width
        title = sub._suptitle.get_window_extent(renderer)
        assert fig.bbox.contains(title.x0, title.y0) and fig.bbox.contains(title.x1, title.y1)


def test_rows_pack_transitions_without_splitting_one():
    assert plots._rows([1, 2, 1, 2, 2, 3, 2], 4) == [[0, 1, 2], [3, 4], [5], [6]]
    assert plots._rows([5, 1], 4) == [[0], [1]]


# --- 4. bank conflicts as a share of the shared-memory traffic ---

def profile_with_wavefronts(conflicts, wavefronts):
    """The synthetic profile with the given load bank conflicts and wavefronts per stage slug."""
    df = synthetic_profile.rows(GPU)
    extra = []
    for slug, value in wavefronts.items():
        row = df[(df["stage"] == slug) & (df["metric"] == "smem_load_bank_conflicts")].iloc[0]
        extra.append(dict(row, metric="smem_wavefronts", value=value))
    df = pd.concat([df, pd.DataFrame(extra)], ignore_index=True)
    for slug, value in conflicts.items():
        df.loc[(df["stage"] == slug) & (df["metric"] == "smem_load_bank_conflicts"), "value"] = value
    return df


def panel(fig, title):
    return next(ax for ax in fig.axes if ax.get_title().replace("\n", " ").startswith(title))


def test_bank_conflicts_as_a_share_of_wavefronts():
    prof = profile_with_wavefronts({"05_mma": 1205, "06_swizzle": 3091},
                                   {"05_mma": 1.1e7, "06_swizzle": 1.1e7})
    fig = plots.idea_metrics(prof, gpu=GPU, only=["06_swizzle"])
    drawn(fig)
    ax = panel(fig, "load bank conflicts, % of shared-memory wavefronts")
    assert ax.get_yscale() == "linear" and ax.get_ylim()[1] >= 100  # the share's whole scale
    assert [b.get_height() for b in ax.patches] == pytest.approx([100 * 1205 / 1.1e7, 100 * 3091 / 1.1e7])
    change = ax.get_xlabel()
    assert change == "+0.017 percentage points"
    assert "more" not in change and "x" not in change
    shown = [t.get_text() for t in ax.texts]
    assert any("3,091 of 11 M" in t for t in shown), shown
    assert panel(fig, "store bank conflicts, % of").get_ylim()[1] >= 100


def test_share_change_in_percentage_points():
    assert plots._change(89.8, 0.163, share=True) == "−90 percentage points"
    assert plots._change(0.011, 0.028, share=True) == "+0.017 percentage points"
    assert plots._change(0.5, 0.0, share=True) == "none left"
    assert plots._change(0.2, 0.2, share=True) == "unchanged"
    assert plots._change(1205, 3091) == "2.6x more"  # counts keep their ratio


def test_bank_conflicts_without_wavefronts_are_counts_on_a_linear_axis():
    fig = plots.idea_metrics(synthetic_profile.rows(GPU), gpu=GPU, only=["03_coarsened"])
    drawn(fig)
    ax = panel(fig, "shared-memory load bank conflicts")
    assert ax.get_yscale() == "linear" and ax.get_xlabel() == "none left"


def test_stage_panel_shows_the_share():
    prof = profile_with_wavefronts({"05_mma": 1205, "06_swizzle": 3091},
                                   {"05_mma": 1.1e7, "06_swizzle": 1.1e7})
    fig = plots.stage_panel("06_swizzle", profile=prof, gpu=GPU)
    cells = [c.get_text().get_text() for t in fig.axes[0].tables for c in t.get_celld().values()]
    assert "load bank conflicts, % of shared-memory wavefronts" in cells
    assert "+0.017 percentage points" in cells and "0.0281 % (3,091)" in cells


def test_the_recorded_share_reads_as_no_regression(data_dir):
    """05_mma -> 06_swizzle: a few thousand conflicts out of 11 million wavefronts."""
    if plots.profile_rows()[0] is None:
        pytest.skip("no profile recorded in data/ yet")
    fig = plots.idea_metrics(only=["06_swizzle"])
    drawn(fig)
    for title in ("load bank conflicts", "store bank conflicts"):
        ax = panel(fig, title)
        assert ax.get_ylim()[1] >= 100 and "percentage points" in ax.get_xlabel()
        assert max(b.get_height() for b in ax.patches) < 1  # under 1 % of the traffic


# --- 5. no spoilers: last= ---

def shown_stages(texts):
    texts = list(texts)  # read once per stage: a generator would be used up by the first stages
    return {st.slug for st in stages() if any(st.slug in t for t in texts)}


def test_ladder_last(data_dir):
    ticks = lambda fig: [t.get_text().replace("\n", "_", 1).split("\n")[0]
                         for t in fig.axes[0].get_xticklabels()]
    assert ticks(plots.ladder(last="03_coarsened")) == ["01_naive", "02_coalesced", "03_coarsened"]
    assert ticks(plots.ladder(last="00")) == []
    assert len(ticks(plots.ladder())) == len(recorded_stages()) >= 13
    baselines = [t.get_text() for t in plots.ladder(last="00").axes[0].texts]
    assert any(t.startswith("sdpa_efficient (fp32)") for t in baselines)


def test_scaling_last(data_dir):
    labels = lambda fig: [t.get_text() for t in fig.legends[0].texts]
    everything = labels(plots.scaling())
    some = labels(plots.scaling(last="05_mma"))
    assert shown_stages(some) <= {st.slug for st in stages() if st.number <= 5}
    assert "05_mma" in some and "08_tuned" in everything and "08_tuned" not in some
    baselines = [n for n in everything if n in plots.BASELINE_STYLE]
    assert baselines and set(baselines) <= set(some)
    assert not shown_stages(labels(plots.scaling(last="00")))


def test_roofline_last(data_dir):
    labels = lambda fig: [a.get_text() for a in fig.axes[0].texts if isinstance(a, Annotation)]
    assert shown_stages(labels(plots.roofline(last="04_wmma"))) == {
        st.slug for st in stages() if st.number <= 4}
    fig = plots.roofline(last="00")
    assert labels(fig) == []
    key = [t.get_text() for leg in fig.findobj(Legend) for t in leg.texts]
    assert "sdpa_flash" in key and "torch_naive" in key  # the baselines stay


@pytest.fixture
def profiled(data_dir):
    synthetic_profile.write(data_dir, tables.gpu_shown())
    return data_dir


def test_idea_metrics_last(profiled):
    titles = lambda fig: [sub._suptitle.get_text().replace("\n", " ") for sub in fig.subfigs]
    shown = titles(plots.idea_metrics(last="04_wmma"))
    assert [t.split(":")[0] for t in shown] == ["01_naive → 02_coalesced",
                                                "02_coalesced → 03_coarsened",
                                                "03_coarsened → 04_wmma"]
    assert len(titles(plots.idea_metrics())) == len([st for st in stages()[1:] if st.idea_metrics])
    assert titles(plots.idea_metrics(last="07", only=["06_swizzle", "08_tuned"]))[0].startswith(
        "05_mma → 06_swizzle")
    assert len(plots.idea_metrics(last="07", only=["06_swizzle", "08_tuned"]).subfigs) == 1
    for last in ("00", "01"):  # nothing to compare yet: said, not an empty grid
        words = [t.get_text() for t in plots.idea_metrics(last=last).findobj(Text)]
        assert any("no stage to compare" in w for w in words), words


def test_stalls_last(profiled):
    rows = lambda fig: [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert rows(plots.stalls(last="03_coarsened")) == ["01_naive", "02_coalesced", "03_coarsened"]
    assert rows(plots.stalls()) == [st.slug for st in stages()]
    assert rows(plots.stalls(last=stage(6).slug, only=["05_mma", "06_swizzle", "07_cp_async"])) == [
        "05_mma", "06_swizzle"]
    words = [t.get_text() for t in plots.stalls(last="00").findobj(Text)]
    assert any("the baselines alone" in w for w in words)


def test_the_readme_and_report_figures_show_every_stage(profiled):
    """save_all and the report draw with last=None: every stage."""
    draw = plots.drawings()
    fig = draw["roofline"]()
    assert shown_stages(a.get_text() for a in fig.axes[0].texts) == set(recorded_stages())
    assert [t.get_text() for t in draw["stalls"]().axes[0].get_yticklabels()] == [
        st.slug for st in stages()]  # the synthetic profile has every stage


def test_every_stage_has_its_own_colour_and_the_sweep_stages_their_own_markers():
    """The sweep figures draw 05 on together: no two stages share a colour, none is a baseline's,
    and the fast stages differ in marker too."""
    colours = plots._stage_colors()
    assert len(set(colours.values())) == len(colours)
    assert not set(colours.values()) & {c for c, _ in plots.BASELINE_STYLE.values()}
    fast = [st.slug for st in stages() if st.fast]
    assert len({plots._marker_of(s) for s in fast}) == len(fast)


def test_the_backward_over_the_sweep_shows_backward_rows_only(data_dir):
    """From the recorded data: the stages with a backward pass and SDPA's backwards, on the GPU
    that timed them over the sweep; no forward row reaches it."""
    fig = plots.backward_scaling()
    labels = {t.get_text() for t in fig.legends[0].texts}
    assert {"sdpa_flash", "sdpa_cudnn"} <= labels
    assert labels - {"sdpa_flash", "sdpa_cudnn"} <= {st.slug for st in stages() if st.has_backward}
    assert tables.sweep_gpu(pass_="backward") in fig._suptitle.get_text()
    drawn(fig)
    path = plots.save_backward_scaling()
    assert path.exists()


def test_without_a_backward_sweep_the_figure_says_what_to_run():
    empty = pd.DataFrame([result("15_backward_mma", "fp16", 100.0)]).assign(**{"pass": "backward",
                                                                               "gpus": 1})
    with pytest.raises(tables.NotRecorded, match="measure_backward"):
        plots.backward_scaling(df=empty)
