"""`flashlab new-stage NN slug --from MM`: a new stage's three files, written from the stage it
builds on, as README.md's "Adding a stage" describes them.

1. kernels/NN_slug.cu: stage MM's kernel file, its __global__ function renamed NN's (the
   registry's `kernel`), and every exercise region of MM turned into a region that carries it
   (`// BEGIN CARRIED MM.name`), so an edition handing out MM's exercise stubs it here too.
2. Its entry in flashlab/stages.py: MM's entry with the new number, slug, title, idea and kernel
   (and builds_on=MM where MM is not the stage just before it), in its place in number order.
3. notebooks/src/NN_slug.py: a lesson's skeleton in the notebook conventions (objectives,
   prerequisites and time; the idea; the diff against MM; a prediction, the measurement and its
   discussion; the profile; questions; the summary), every part to be written marked "(write".

and a row for it in notebooks/TEACHING.md's course map (its minutes are the notebook's own, so
the total is summed again). Then it prints the commands that record the stage.
"""
import ast
import re

from . import markers, paths
from .stages import stage as get_stage
from .stages import stages as all_stages

SLUG = re.compile(r"[a-z][a-z0-9_]*")
WRITE = "(write"  # how the skeleton marks what its author writes


def _entry_source(registry: str, number: int):
    """(first line, last line), 0-based and inclusive, of stage `number`'s Stage(...) in the
    registry's source."""
    tree = ast.parse(registry)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Stage" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == number):
            return node.lineno - 1, node.end_lineno - 1
    raise ValueError(f"no Stage({number}, ...) in flashlab/stages.py")


def _set(entry: str, name: str, value: str) -> str:
    """entry with keyword `name` set to the Python source `value` (added before the closing
    parenthesis where the entry does not give it)."""
    pat = re.compile(rf"(\b{name}=)(\"(?:[^\"\\]|\\.)*\"|[^,\n)]+)")
    if pat.search(entry):
        return pat.sub(lambda m: m[1] + value, entry, count=1)
    head, tail = entry.rstrip().rsplit(")", 1)
    return f"{head.rstrip()},\n          {name}={value}){tail}"


def registry_entry(registry: str, old, number, slug, title, idea, kernel, builds_on=None) -> str:
    """Stage `old`'s entry in the registry's source, as the new stage's."""
    lines = registry.splitlines()
    first, last = _entry_source(registry, old.number)
    # its comments speak of stage `old`'s idea: left out
    entry = "\n".join(ln for ln in lines[first:last + 1]
                      if not ln.lstrip().startswith("#")).rstrip().rstrip(",")
    indent = entry[:len(entry) - len(entry.lstrip())]
    entry = entry.lstrip()
    call = ast.parse(entry).body[0].value
    # the positional arguments: number, slug, title, idea (each a constant or adjacent strings),
    # replaced from the last so that the earlier ones' offsets hold
    starts = [0, *(len(ln) + 1 for ln in entry.splitlines())]
    offsets = [sum(starts[:n]) for n in range(1, len(starts) + 1)]
    for node, value in reversed(list(zip(call.args[:4], (number, slug, title, idea)))):
        a = offsets[node.lineno - 1] + node.col_offset
        b = offsets[node.end_lineno - 1] + node.end_col_offset
        entry = entry[:a] + (repr(value) if isinstance(value, int) else _q(value)) + entry[b:]
    entry = indent + entry
    entry = _set(entry, "kernel", _q(kernel))
    if builds_on is not None:
        entry = _set(entry, "builds_on", str(builds_on))
    return entry + ","


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def insert_entry(registry: str, entry: str, number: int) -> str:
    """The registry's source with `entry` placed in number order in _STAGES."""
    lines = registry.splitlines(keepends=True)
    later = [st for st in all_stages() if st.number > number]
    if later:
        at, _ = _entry_source(registry, later[0].number)
    else:
        at, end = _entry_source(registry, all_stages()[-1].number)
        at = end + 1
    return "".join(lines[:at]) + entry + "\n" + "".join(lines[at:])


def kernel_text(text: str, old, kernel: str) -> str:
    """Stage `old`'s kernel file as the new stage's: its __global__ function renamed, and its
    exercise regions carried (the new stage keeps MM's solution)."""
    text = re.sub(rf"\b{re.escape(old.kernel)}\b", kernel, text)
    text = re.sub(r"^([ \t]*// (?:BEGIN|END)) EXERCISE ", r"\1 CARRIED ", text, flags=re.M)
    markers.regions(text, f"kernels/{old.slug}.cu (as carried)")  # still well formed
    return text


WORDS_PER_MINUTE = 120  # how fast a notebook's stated read time assumes its prose is read
WORK_MINUTES = 20        # the skeleton's time to work through, until its exercises are written


def prose_words(text: str) -> int:
    """The words of a percent-format notebook source's markdown cells."""
    words, markdown = 0, False
    for line in text.splitlines():
        if line.startswith("# %%"):
            markdown = line.startswith("# %% [markdown]")
        elif markdown and line.startswith("#"):
            words += len(line[1:].split())
    return words


def read_minutes(text: str) -> int:
    """The read time a notebook source states for its prose: its words at 120 a minute."""
    return max(1, round(prose_words(text) / WORDS_PER_MINUTE))


def notebook_text(number: int, slug: str, title: str, idea: str, old) -> str:
    """The skeleton, its stated read time its own prose's (the author's prose makes it grow)."""
    text = _skeleton(number, slug, title, idea, old, "READ_MINUTES")
    return text.replace("READ_MINUTES", str(read_minutes(text)))


def _skeleton(number: int, slug: str, title: str, idea: str, old, read) -> str:
    nn, mm = f"{number:02d}", f"{old.number:02d}"
    return f'''# %% [markdown]
# # Stage {nn} — {title}
#
# Stage {mm} ({old.title.lower()}) {WRITE}: where its time goes). This stage changes one thing:
# {idea}.
#
# ## Objectives
# After this notebook you can:
# - {WRITE}: what a student can do with this stage's idea);
# - {WRITE}: what they can predict with it);
# - {WRITE}: what they can read off its profile).
#
# **Prerequisites:** notebook {mm}.
#
# **Time:** about {read} min to read, {WORK_MINUTES} min to work through.

# %%
# %matplotlib inline
import flashlab as fl
from flashlab import notebook as nb
nb.banner("{slug}")

# %%
print(nb.the_gpu())  # this GPU, or the one the recorded numbers come from

# %% [markdown]
# ## 1 · The idea
#
# {WRITE}: the idea, with a figure drawn by this stage's lesson module).

# %% [markdown]
# ## 2 · What changed
#
# The whole change against stage {mm}:

# %%
nb.show_diff("{old.slug}", "{slug}", context=1)

# %% [markdown]
# ## 3 · Prediction
#
# {WRITE}: a number, from a model of what the change moves).

# %%
with nb.unless_missing():
    print(nb.evaluate("{slug}"))

# %%
with nb.unless_missing():
    print(f"{{nb.speedup('{old.slug}', '{slug}', '{old.dtypes[0]}'):.2f}}x stage {mm}")

# %% [markdown]
# ### Discussion
#
# {WRITE}: the prediction against the measurement, and why they differ).

# %% [markdown]
# ## 4 · The profile

# %%
with nb.unless_missing():
    print(nb.profile("{slug}"))

# %% [markdown]
# ### Discussion
#
# {WRITE}: what the profile proves of the idea).

# %% [markdown]
# ## Questions for discussion
#
# 1. {WRITE}).
# 2. {WRITE}).

# %% [markdown]
# ## Summary
#
# - {WRITE}).

# %%
nb.reached("{slug}")
'''


def course_map_row(number: int, slug: str, title: str, old, minutes=(1, WORK_MINUTES)) -> str:
    st_cc = ".".join(map(str, old.min_cc)) + (" (Hopper only)" if old.arch_specific else "")
    return (f"| [{number:02d} — {title}]({slug}.ipynb) | {WRITE}: what a student can do after it) "
            f"| {old.number:02d} | {minutes[0]} | {minutes[1]} | {st_cc} |")


def add_to_course_map(guide: str, row: str, number: int) -> str:
    """TEACHING.md with `row` placed in its course map after the last notebook numbered below
    `number`, and the total row summed again."""
    lines = guide.splitlines()
    start = lines.index("## Course map")
    rows = [i for i in range(start, len(lines)) if lines[i].startswith("| [")]
    before = [i for i in rows if int(re.match(r"\| \[(\d+)", lines[i])[1]) <= number]
    at = (before[-1] if before else rows[0] - 1) + 1
    lines.insert(at, row)
    total = next(i for i in range(start, len(lines)) if lines[i].startswith("| **total**"))
    body = [ln for ln in lines[start:total] if ln.startswith("| [")]
    read = sum(int(ln.split("|")[4]) for ln in body)
    work = sum(int(ln.split("|")[5]) for ln in body)
    lines[total] = f"| **total** | | | **{read}** | **{work}** | |"
    return "\n".join(lines) + "\n"


def new_stage(number, slug, source, title=None, idea=None) -> list:
    """Write stage `number`'s files from stage `source`'s (see the module's doc); returns the
    paths written. ValueError (nothing written) where the number or the name is taken, the slug is
    not lower_case, or `source` is no stage."""
    root = paths.ROOT  # the checkout whose registry is imported: its files and its stages agree
    old = get_stage(source)
    number = int(number)
    if not 1 <= number <= 98:
        raise ValueError(f"a stage's number is 1 to 98, not {number}")
    if any(st.number == number for st in all_stages()):
        raise ValueError(f"stage {number:02d} exists: {get_stage(number).slug}")
    if not SLUG.fullmatch(slug):
        raise ValueError(f"the name {slug!r} is not lower_case_with_underscores")
    full = f"{number:02d}_{slug}"
    kernel = f"{slug}_kernel"
    title = title or slug.replace("_", " ").capitalize()
    idea = idea or f"{WRITE}: the one technique this stage adds)"
    cu = root / "kernels" / f"{full}.cu"
    nb_src = root / "notebooks" / "src" / f"{full}.py"
    registry = root / "flashlab" / "stages.py"
    guide = root / "notebooks" / "TEACHING.md"
    for p in (cu, nb_src):
        if p.exists():
            raise ValueError(f"{p.relative_to(root)} exists")
    if re.search(rf'kernel="{kernel}"', registry.read_text()):
        raise ValueError(f"another stage's kernel is called {kernel}")
    previous = max((st for st in all_stages() if st.number < number), key=lambda s: s.number,
                   default=None)
    builds_on = None if previous is not None and previous.number == old.number else old.number
    new_cu = kernel_text(old.source.read_text(), old, kernel)
    text = registry.read_text()
    new_registry = insert_entry(text, registry_entry(text, old, number, full, title, idea, kernel,
                                                     builds_on), number)
    ast.parse(new_registry)
    skeleton = notebook_text(number, full, title, idea, old)
    row = course_map_row(number, full, title, old, (read_minutes(skeleton), WORK_MINUTES))
    new_guide = add_to_course_map(guide.read_text(), row, number)
    cu.write_text(new_cu)
    registry.write_text(new_registry)
    nb_src.write_text(skeleton)
    guide.write_text(new_guide)
    return [cu, registry, nb_src, guide]


def next_steps(number, slug, old) -> str:
    """What records the new stage, in order (all but the last two need no GPU). The files are
    committed first: a recorded row names the commit it was made at, and a '-dirty' one names
    nothing anyone can check out."""
    nn = f"{number:02d}"
    archs = old.static_archs
    lines = [f"python tools/notebooks.py build {nn}            # notebooks/{nn}_{slug}.ipynb",
             f'git add -A && git commit -m "stage {nn}: {slug}"   # recorded rows name a clean commit',
             *(f"flashlab sass {nn} --arch {a} --record            # data/sass.csv" for a in archs),
             "flashlab readme                                 # README.md's tables",
             f"flashlab run --stage {nn} --profile               # on a GPU: checked, timed, profiled",
             f"python tools/notebooks.py execute {nn}          # on a GPU: the notebook's outputs"]
    return "\n".join(lines)
