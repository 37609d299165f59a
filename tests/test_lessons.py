"""The notebooks as lessons (CPU only, from their percent-format sources): each opens with its
objectives, prerequisites and time, discusses every prediction after measuring it, closes with
questions and a summary, shows no later stage in its figures, and talks about attention and the
GPU rather than about how the workbook was made."""
import re
import sys

import pytest

from flashlab import paths

sys.path.insert(0, str(paths.ROOT / "tools"))
import notebooks as nbtool  # noqa: E402

SOURCES = sorted((paths.ROOT / "notebooks" / "src").glob("*.py"))
HEADING = re.compile(r"^(#{1,3}) (.+)$", re.M)
WORD = re.compile(r"[A-Za-z0-9][\w'’.-]*")
FIGURES = ("ladder", "roofline", "scaling")
# How the workbook was made is not part of the lesson.
HISTORY = [r"\bproject\b", r"\bproject's\b", r"\bGitHub issue", r"\bthe issue (that|which|asked|quoted)",
           r"\bearlier version of (this|the)", r"\bacceptance\b", r"\btarget of \d", r"\btarget —",
           r"\bflashlab added\b", r"\bTODO\b", r"\bfiled\b"]


def cells(src):
    return nbtool.parse(src.read_text())


def markdown(src):
    return [body for kind, body in cells(src) if kind == "markdown"]


def headings(src):
    return [m.group(2).strip() for body in markdown(src) for m in HEADING.finditer(body)]


def stage_of(src):
    """The stage a notebook's banner names ('00' for notebook 00)."""
    m = re.search(r'nb\.banner\("([^"]+)"\)', src.read_text())
    return m.group(1) if m else "00"


def ids(paths_):
    return [pytest.param(p, id=p.stem) for p in paths_]


def test_there_are_notebooks():
    assert len(SOURCES) >= 9


@pytest.mark.parametrize("src", ids(SOURCES))
def test_opens_with_objectives_prerequisites_and_time(src):
    opening = "\n".join(markdown(src)[:2])
    assert "## Objectives" in opening, f"{src.name}: no '## Objectives' in its first markdown cells"
    block = opening.split("## Objectives", 1)[1]
    block = re.split(r"\n\*\*|\n#", block, maxsplit=1)[0]
    bullets = [ln for ln in block.splitlines() if ln.startswith("- ")]
    assert 3 <= len(bullets) <= 5, f"{src.name}: {len(bullets)} objectives (3 to 5)"
    assert "**Prerequisites:**" in opening, src.name
    assert re.search(r"\*\*Time:\*\*.*?\d+ min to read.*?\d+ min to work", opening), \
        f"{src.name}: '**Time:** about N min to read, M min to work through'"


@pytest.mark.parametrize("src", ids(SOURCES))
def test_closes_with_questions_and_a_summary(src):
    hs = [h for h in headings(src) if not h.startswith("Discussion")]
    assert hs[-1] == "Summary", f"{src.name}: its last section is {hs[-1]!r}, not 'Summary'"
    if "_appendix" not in src.stem and not re.match(r"\d+[a-z]_", src.stem):
        assert hs[-2] == "Questions for discussion", f"{src.name}: {hs[-2]!r} before the summary"
        questions = [b for b in markdown(src) if b.startswith("## Questions for discussion")][0]
        assert len(re.findall(r"^\d+\. ", questions, re.M)) >= 2, f"{src.name}: fewer than 2 questions"
    st = stage_of(src)
    if st != "00" and not re.match(r"\d+[a-z]_", src.stem):
        last_code = [body for kind, body in cells(src) if kind == "code"][-1]
        assert f'nb.reached("{st}")' in last_code, \
            f"{src.name}: the last code cell should print the number reached: nb.reached({st!r})"


@pytest.mark.parametrize("src", ids(SOURCES))
def test_every_prediction_is_discussed_after_it_is_measured(src):
    seq = cells(src)
    predictions = [i for i, (kind, body) in enumerate(seq) if kind == "markdown"
                   and re.search(r"^#{2,3} .*Prediction", body, re.M)
                   and not re.search(r"^#{2,3} .*(against|vs\.?) (the )?measure", body, re.M)]
    discussions = [i for i, (kind, body) in enumerate(seq) if kind == "markdown"
                   and body.startswith("### Discussion")]
    for i in predictions:
        later = [j for j in discussions if j > i]
        assert later, f"{src.name}: the prediction in cell {i} is never discussed after it"
        j = later[0]
        assert any(kind == "code" for kind, _ in seq[i:j]), \
            f"{src.name}: cell {j}'s discussion comes before anything measures cell {i}'s prediction"
    assert len(discussions) >= len(predictions)


@pytest.mark.parametrize("src", ids(SOURCES))
def test_no_prewritten_verdicts(src):
    """A discussion is written from the numbers; code that picks a canned sentence from them is
    not one."""
    for kind, body in cells(src):
        if kind != "code":
            continue
        for ln in body.splitlines():
            assert not re.search(r"""print\(\s*["'](Faster|Slower|Met|NOT met|The prediction held)""", ln), \
                f"{src.name}: pre-written verdict: {ln.strip()}"
            assert not re.search(r"""['"](met|NOT met)['"] if""", ln), f"{src.name}: {ln.strip()}"


@pytest.mark.parametrize("src", ids(SOURCES))
def test_talks_about_attention_and_the_gpu_not_the_project(src):
    text = "\n".join(markdown(src)) + "\n".join(body for kind, body in cells(src) if kind == "code")
    found = [m.group(0) for pat in HISTORY for m in re.finditer(pat, text, re.I)]
    assert not found, f"{src.name} talks about how the workbook was made: {found}"


@pytest.mark.parametrize("src", ids(SOURCES))
def test_figures_show_no_later_stage(src):
    st = stage_of(src)
    for kind, body in cells(src):
        if kind != "code":
            continue
        for m in re.finditer(r"plots\.(%s)\(([^()]*(\([^()]*\))?[^()]*)\)" % "|".join(FIGURES), body):
            assert f'last="{st}"' in m.group(2), \
                f"{src.name}: plots.{m.group(1)}({m.group(2)}) should pass last={st!r}"


def prose_words(src):
    """Words a student reads: the instructor's answers (solution edition only) left out."""
    return sum(len(WORD.findall(b)) for b in markdown(src)
               if not b.startswith("**Instructor's answer.**"))


def test_notebook_08_is_a_lesson_not_a_log():
    src = next(p for p in SOURCES if p.stem.startswith("08_"))
    code = [b for kind, b in cells(src) if kind == "code"]
    assert prose_words(src) <= 1550, f"{prose_words(src)} words of prose"
    assert len(code) <= 21, f"{len(code)} code cells"   # the lab takes 3: prompt, answer, check
