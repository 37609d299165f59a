"""notebooks/TEACHING.md, the instructor guide, cannot drift from what it describes: its course
map lists every notebook with the minutes that notebook's own opening cell gives, its "live on"
column is the registry's, its exercise table names the registered exercises, and it and README's
Colab section link each other."""
import re

import pytest

import flashlab as fl
from flashlab import paths

GUIDE = paths.NOTEBOOKS / "TEACHING.md"
README = paths.ROOT / "README.md"
SOURCES = sorted((paths.NOTEBOOKS / "src").glob("[0-9][0-9]*.py"))
TIME = re.compile(r"\*\*Time:\*\*\s+about\s+(\d+)\s+min\s+to\s+read,\s+(\d+)\s+min\s+to\s+work")


def _section(text, heading):
    """The lines of the section under `## heading`, up to the next `## `."""
    lines = text.splitlines()
    start = lines.index(f"## {heading}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start + 1:end]


def _table(lines):
    """The first Markdown table in `lines`: (header cells, [row cells])."""
    rows = [ln for ln in lines if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows]
    assert len(cells) >= 3 and set(rows[1]) <= set("|-: "), "no table found"
    return cells[0], cells[2:]


def _course_map():
    header, rows = _table(_section(GUIDE.read_text(), "Course map"))
    col = {name: i for i, name in enumerate(header)}
    by_stem = {}
    for row in rows:
        m = re.search(r"\]\((\d\d[a-z]?_\w+)\.ipynb\)", row[col["notebook"]])
        if m:
            assert m.group(1) not in by_stem, f"{m.group(1)} is listed twice"
            by_stem[m.group(1)] = row
        elif "total" in row[col["notebook"]]:
            by_stem["total"] = row
    return col, by_stem


def _minutes(source):
    m = TIME.search(source.read_text())
    assert m, f"{source.name} has no '**Time:** about N min to read, M min to work through' line"
    return int(m.group(1)), int(m.group(2))


def test_the_guide_exists_and_links_readme_and_back():
    text = GUIDE.read_text()
    assert "](../README.md#run-it-on-colab)" in text
    readme = README.read_text()
    assert "\n## Run it on Colab\n" in readme  # the anchor the guide links to
    assert "](notebooks/TEACHING.md)" in readme


def test_the_course_map_lists_every_notebook_once():
    _, by_stem = _course_map()
    assert SOURCES, "no notebook sources"
    listed = sorted(k for k in by_stem if k != "total")
    assert listed == [p.stem for p in SOURCES]
    for stem in listed:
        assert (paths.NOTEBOOKS / f"{stem}.ipynb").is_file(), f"the map links {stem}.ipynb"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_course_map_minutes_are_the_notebooks_own(source):
    col, by_stem = _course_map()
    row = by_stem[source.stem]
    read, work = _minutes(source)
    assert (int(row[col["read (min)"]]), int(row[col["work (min)"]])) == (read, work), \
        f"{source.stem}: TEACHING.md says read {row[col['read (min)']]}, work " \
        f"{row[col['work (min)']]}; the notebook says {read}, {work}"


def test_course_map_totals_add_up():
    col, by_stem = _course_map()
    read = sum(_minutes(p)[0] for p in SOURCES)
    work = sum(_minutes(p)[1] for p in SOURCES)
    total = by_stem["total"]
    assert total[col["read (min)"]].strip("*") == str(read)
    assert total[col["work (min)"]].strip("*") == str(work)


def test_live_on_is_what_the_registry_says():
    col, by_stem = _course_map()
    for stem, row in by_stem.items():
        number = stem[:2]
        if stem == "total" or number == "00":
            continue
        numbers = {s.number for s in fl.stages()}
        # a notebook about no one stage (ring attention, the capstone) runs the stage it builds on
        from flashlab.course.student import BEYOND_STAGES
        st = fl.stage(number) if int(number) in numbers else fl.stage(BEYOND_STAGES[int(number)])
        live = row[col["live on"]]
        assert live.startswith(".".join(map(str, st.min_cc))), (stem, live)
        for dt, cc in st.dtype_min_cc.items():
            assert f"{dt} {'.'.join(map(str, cc))}" in live, (stem, live)


def test_the_exercise_table_names_the_registered_exercises():
    exercises = pytest.importorskip("flashlab.course.exercises")
    lines = _section(GUIDE.read_text(), "The exercises and the GPUs they need")
    header, rows = _table(lines)
    named = {}
    for row in rows:
        for cell in row[1:]:
            for ex_id in re.findall(r"`(\d\d\.\w+)`", cell):
                named[ex_id] = row[0]
    registered = {ex.id: ex for ex in exercises.EXERCISES}
    assert sorted(named) == sorted(registered)
    for ex_id, notebook in named.items():
        assert registered[ex_id].home.startswith(notebook), (ex_id, notebook)


def _exercise_minutes():
    lines = _section(GUIDE.read_text(), "The exercises and the GPUs they need")
    header, rows = _table(lines)
    return {ex_id: int(m) for row in rows for cell in row[1:]
            for ex_id, m in re.findall(r"`(\d\d\.\w+)` \((\d+) min\)", cell)}


def test_every_exercise_has_its_minutes():
    exercises = pytest.importorskip("flashlab.course.exercises")
    minutes = _exercise_minutes()
    assert sorted(minutes) == sorted(ex.id for ex in exercises.EXERCISES)
    assert all(5 <= m <= 60 for m in minutes.values())


def test_the_workshops_slots_add_up_to_the_notebooks_own_times():
    """Each slot of the three-hour workshop lasts the read time of its notebook (its opening
    cell's) plus the minutes of the exercises done in it (homework does not count); a break or
    a wrap-up lasts what it says; the slots follow each other and fill three hours."""
    text = "\n".join(_section(GUIDE.read_text(), "Two plans"))
    part = text.split("### A three-hour workshop", 1)[1].split("### A four-week module", 1)[0]
    header, rows = _table(part.splitlines())
    minutes = _exercise_minutes()
    reads = {src.name[:2]: _minutes(src)[0] for src in SOURCES}
    clock = 0
    for row in rows:
        start, end = (int(h) * 60 + int(m) for h, m in re.findall(r"(\d):(\d\d)", row[0]))
        assert start == clock, row
        m = re.fullmatch(r"(\d\d) \((\d+)\)", row[1])
        if m:
            assert int(m.group(2)) == reads[m.group(1)], (row, "the notebook's read time")
            done = re.findall(r"`(\d\d\.\w+)`", row[3].split("homework:")[0])
            want = reads[m.group(1)] + sum(minutes[ex] for ex in done)
            for ex in done:
                assert f"`{ex}` ({minutes[ex]})" in row[3], (row, ex)
        else:
            want = int(re.search(r"\((\d+)\)", row[1]).group(1))
        assert end - start == want, (row, want)
        clock = end
    assert clock == 180


# --- a notebook's stated read time is its length -------------------------------------------------

WORDS_PER_MINUTE = 120   # dense technical prose, read with the figures and outputs beside it
STAGE_WORDS_MAX = 3000   # a notebook's aim on the student path (appendix logs, NNa_, aside)


def _prose_words(source):
    """The words of a notebook's student-facing prose: every markdown cell of its source."""
    jupytext = pytest.importorskip("jupytext")
    nb = jupytext.read(source)
    return sum(len(c.source.split()) for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_the_stated_read_time_matches_the_prose(source):
    """'about R min to read' is the prose at 120 words a minute, within a fifth (or a minute, for
    a skeleton that `flashlab new-stage` just wrote)."""
    words = _prose_words(source)
    read, _ = _minutes(source)
    expected = words / WORDS_PER_MINUTE
    assert abs(read - expected) <= max(1, 0.2 * expected), \
        f"{source.stem}: {words} words read in about {expected:.0f} min at {WORDS_PER_MINUTE} " \
        f"words a minute; the notebook says {read}"


@pytest.mark.parametrize("source", [p for p in SOURCES if re.fullmatch(r"\d\d_\w+", p.stem)],
                         ids=lambda p: p.stem)
def test_a_notebook_on_the_student_path_is_at_most_3000_words(source):
    words = _prose_words(source)
    assert words <= STAGE_WORDS_MAX, f"{source.stem}: {words} words of prose (at most {STAGE_WORDS_MAX})"
