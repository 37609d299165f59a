"""`flashlab report`: one page for a class handout — what flashlab is, where the numbers come
from, the stage table and every figure, all drawn fresh from data/ so the page always agrees
with the tables, then each notebook's questions for discussion. HTML embeds the figures (one
file that opens offline); Markdown writes them as PNGs beside the page and links them."""
import base64
import html
import io
import os
import re
from pathlib import Path

from . import cells, paths, plots, readme, tables
from .stages import stage

TITLE = "flashlab: FlashAttention, one optimisation at a time"
ABOUT = ("flashlab is a workbook that builds a FlashAttention CUDA kernel in stages, each one "
         "differing from the one before by a single idea. Every stage is checked against a "
         "float64 reference and timed next to PyTorch's own attention on the same GPU, and every "
         "number below comes from a recorded run, none typed by hand.")
CAPTIONS = {
    "ladder": "Every stage's speed at the teaching config; PyTorch's attention backends are the "
              "horizontal lines. Each step up is one idea.",
    "scaling": "Speed against sequence length over the FlashAttention paper's sweep: the targets, "
               "and each stage fast enough to be swept.",
    "roofline": "Every stage and baseline against the GPU's measured ceilings: below the slanted "
                "line a kernel is limited by memory traffic, below the flat ones by arithmetic.",
    "idea_metrics": "The hardware counter each stage's idea is meant to move, measured by Nsight "
                    "Compute in the stage before and in the stage itself; bank conflicts as a "
                    "share of all shared-memory wavefronts, the traffic they add to.",
    "stalls": "What the warps of each stage are waiting on, as a share of their active time.",
}
STYLE = """body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;max-width:64rem;
margin:2rem auto;padding:0 1rem;line-height:1.45;color:#222}
table{border-collapse:collapse;font-size:.85rem;margin:1rem 0}th,td{border:1px solid #ccc;
padding:.25rem .5rem;vertical-align:top}th{background:#f4f4f4}.num{text-align:right}
dl{display:grid;grid-template-columns:max-content auto;gap:.2rem 1rem}dt{font-weight:600}dd{margin:0}
figure{margin:1.5rem 0;break-inside:avoid}img{max-width:100%}figcaption{color:#444;font-size:.9rem}
code{font-size:.9em}"""


NOTEBOOKS = paths.NOTEBOOKS  # where the notebooks' discussion questions are read from
QUESTIONS = "## Questions for discussion"


def questions(notebooks=None):
    """[(title, the questions as Markdown)] of every notebook NN*.ipynb in `notebooks` (default
    NOTEBOOKS) with a markdown cell whose first line is "## Questions for discussion", in order;
    the title is the notebook's first heading, without its #s."""
    out = []
    for path in sorted(Path(NOTEBOOKS if notebooks is None else notebooks).glob("[0-9][0-9]*.ipynb")):
        markdown = [src for kind, src in cells.read(path) if kind == "markdown"]
        lines = [line.strip() for src in markdown for line in src.splitlines()]
        title = next((line.lstrip("#").strip() for line in lines if line.startswith("#")), path.stem)
        for src in markdown:
            first, _, rest = src.strip().partition("\n")
            if first.strip() == QUESTIONS and rest.strip():
                out.append((title, rest.strip("\n")))
                break
    return out


_CODE = re.compile(r"(`[^`]+`)")
_INLINE = [(re.compile(r"\[([^\]]+)\]\([^)\s]+\)"), r"\1"),  # a link's words: the page fetches nothing
           (re.compile(r"\*\*([^*]+)\*\*"), r"<b>\1</b>"),
           (re.compile(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])"), r"<i>\1</i>"),
           # simple maths ($PV$) in italics; TeX ($B \cdot H$) and lone dollars stay as written
           (re.compile(r"(?<![\w$])\$(?=[^\s$])([^$\\{}]+?)(?<=\S)\$(?![\w$])"), r"<i>\1</i>")]
_ITEM = re.compile(r"^\s*(\d+)[.)]\s+(.*)")


def _inline_html(text):
    """One line of Markdown as HTML: code spans verbatim, then the rest of _INLINE outside them."""
    out = []
    for i, part in enumerate(_CODE.split(text)):
        if i % 2:
            out.append(f"<code>{html.escape(part[1:-1], quote=False)}</code>")
            continue
        part = html.escape(part, quote=False)
        for pattern, repl in _INLINE:
            part = pattern.sub(repl, part)
        out.append(part)
    return "".join(out)


def _questions_html(markdown):
    """A numbered list (with continuation lines, and paragraphs around it) as HTML, with the
    inline Markdown the notebooks use: `code`, **bold**, *italic*, $PV$, [links](...) as their words."""
    blocks = []  # ("ol", [item lines, ...]) or ("p", [lines])
    for line in markdown.splitlines():
        item = _ITEM.match(line)
        if item:
            if not blocks or blocks[-1][0] != "ol":
                blocks.append(("ol", []))
            blocks[-1][1].append([item.group(1), item.group(2).strip()])
        elif not line.strip():
            if blocks and blocks[-1][0] == "p":
                blocks.append(("ol", []))  # a blank line ends a paragraph
        elif blocks and blocks[-1][0] == "ol" and blocks[-1][1] and line[:1].isspace():
            blocks[-1][1][-1].append(line.strip())  # an item's continuation line
        else:
            if not blocks or blocks[-1][0] != "p":
                blocks.append(("p", []))
            blocks[-1][1].append(line.strip())
    html_ = []
    for kind, lines in blocks:
        if kind == "p":
            html_.append(f"<p>{_inline_html(' '.join(lines))}</p>")
        elif lines:
            start = "" if lines[0][0] == "1" else f' start="{int(lines[0][0])}"'
            html_.append(f"<ol{start}>" + "".join(f"<li>{_inline_html(' '.join(i[1:]))}</li>"
                                                  for i in lines) + "</ol>")
    return "\n".join(html_)


def caption(name):
    if name.startswith("stage_"):
        st = stage(name[len("stage_"):])
        return f"What changed in {st.slug} ({st.title.lower()}) against the stage before it."
    return CAPTIONS.get(name, name)


def provenance(df, gpu, profile=None):
    """(label, value) pairs saying where the page's numbers come from, read from the rows."""
    if gpu is None:
        return [("results", "nothing recorded yet (flashlab run, on a GPU, records it)")]
    rows = df[df["gpu"] == gpu]
    items = [("GPU", f"{gpu} (compute capability {_values(rows, 'compute_capability')})")]
    items += _software(rows)
    prof, _ = plots.profile_rows(profile, gpu)
    if prof is not None:
        items.append(("Nsight Compute profile", "; ".join(f"{k} {v}" for k, v in _software(prof))))
    return items


def _values(rows, col):
    """The distinct values of a column: one if the rows agree, all of them if not."""
    return ", ".join(sorted(set(rows[col].dropna().astype(str)))) or "–"


def _software(rows):
    times = sorted(rows["time"].dropna().astype(str))
    when = "–" if not times else times[0] if times[0] == times[-1] else f"{times[0]} to {times[-1]}"
    return [("torch", _values(rows, "torch")), ("CUDA", _values(rows, "cuda")),
            ("commit", _values(rows, "commit")), ("measured", when)]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()


def _sections(names):
    """Figure names under the page's headings: the results figures, then the profile's."""
    compare = [n for n in names if n in plots.FIGURES]
    inside = [n for n in names if n not in plots.FIGURES]
    return [(heading, chosen) for heading, chosen in (("How the stages compare", compare),
            ("Inside the kernels (Nsight Compute)", inside)) if chosen]


def render(fmt="html", out=None, df=None, profile=None) -> str:
    """The page as text. For Markdown, the figures are written as PNGs in a folder beside `out`."""
    out = Path(out) if out is not None else default_path(fmt)
    df = tables.RESULTS.load() if df is None else df
    gpu = tables.gpu_shown(df=df)
    drawings = plots.drawings(df, profile, gpu)
    prov = provenance(df, gpu, profile)
    asked = questions()
    if fmt == "html":
        table = readme.stage_table(df, fmt="html", notebooks=None, by="flashlab report")
        return _html(prov, table, drawings, asked)
    notebooks = Path(os.path.relpath(paths.NOTEBOOKS, out.parent)).as_posix() + "/"
    table = readme.stage_table(df, fmt="md", notebooks=notebooks, by="flashlab report")
    return _markdown(prov, table, drawings, out, asked)


def _html(prov, table, drawings, asked=()):
    e = html.escape
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{e(TITLE)}</title><style>{STYLE}</style></head><body>",
             f"<h1>{e(TITLE)}</h1>", f"<p>{e(ABOUT)}</p>",
             "<h2>Where these numbers come from</h2>", "<dl>"]
    parts += [f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in prov]
    parts += ["</dl>", "<h2>The stages at the teaching config</h2>", table]
    for heading, names in _sections(list(drawings)):
        parts.append(f"<h2>{e(heading)}</h2>")
        for name in names:
            data = base64.b64encode(_png(drawings[name]())).decode("ascii")
            parts.append(f'<figure id="{e(name)}"><img src="data:image/png;base64,{data}" '
                         f'alt="{e(name)}"><figcaption>{e(caption(name))}</figcaption></figure>')
    if asked:
        parts.append(f"<h2>{e(QUESTIONS.lstrip('# '))}</h2>")
        for title, text in asked:
            parts += [f"<h3>{e(title)}</h3>", _questions_html(text)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _markdown(prov, table, drawings, out, asked=()):
    figdir = out.parent / f"{out.stem}_figures"
    parts = [f"# {TITLE}", "", ABOUT, "", "## Where these numbers come from", ""]
    parts += [f"- **{k}**: {v}" for k, v in prov]
    parts += ["", "## The stages at the teaching config", "", table]
    if drawings:
        figdir.mkdir(parents=True, exist_ok=True)
    for heading, names in _sections(list(drawings)):
        parts += ["", f"## {heading}"]
        for name in names:
            (figdir / f"{name}.png").write_bytes(_png(drawings[name]()))
            parts += ["", f"![{name}]({figdir.name}/{name}.png)", "", f"_{caption(name)}_"]
    if asked:
        parts += ["", QUESTIONS]
        for title, text in asked:
            parts += ["", f"### {title}", "", text]
    return "\n".join(parts) + "\n"


def default_path(fmt="html") -> Path:
    return paths.data_dir() / f"report.{fmt}"


def write(out=None, fmt=None) -> Path:
    """Write the page; the format follows `fmt`, else out's suffix, else HTML. Returns its path."""
    fmt = fmt or ("md" if out is not None and Path(out).suffix.lower() == ".md" else "html")
    out = Path(out) if out is not None else default_path(fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(fmt, out), encoding="utf-8")
    return out
