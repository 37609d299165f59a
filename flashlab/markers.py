"""Exercise markers in the kernels' source: where a student writes a stage's idea, and where a
later stage carries that code forward. Pure text: no torch, no build, nothing above the core.

An exercise region, in the stage whose idea it is (kernels/NN_*.cu, the solution edition):

    // BEGIN EXERCISE 03.coarsen_kernel: <the task, in a sentence>
    // <the task, continued: comment lines right after BEGIN belong to it>
    ...the solution code (it starts with a line that is not a comment)...
    // STUB: // TODO: <what the stub leaves undone>
    // STUB: <code that compiles and gives a wrong answer>
    // END EXERCISE 03.coarsen_kernel

A carried region, in a later stage that holds the same code (stage 06 keeps stage 05's online
softmax): the same form with CARRIED for EXERCISE and the id of the exercise it carries. Its STUB
lines may be left out where the code is the exercise's own, unchanged: the exercise's stub
stands in for it then.

    // BEGIN CARRIED 05.online_softmax: stage 05's online softmax, unchanged
    ...the same solution code...
    // END CARRIED 05.online_softmax

Every marker line is a comment, so the solution edition compiles to exactly the code it had
before the markers. An edition that hands an exercise out (flashlab.course.student) keeps BEGIN,
the task and END of its region and of every region carrying it, and puts the stub's code where
the solution was; every other region's markers are removed and its solution stays. A stub's
first line is always a "// TODO:" comment: a region that still holds one has not been written.
"""
import re
from dataclasses import dataclass

EXERCISE, CARRIED = "EXERCISE", "CARRIED"
DEFAULT_POINTS = 10
TODO = "// TODO:"

_BEGIN = re.compile(r"^(?P<indent>[ \t]*)// BEGIN (?P<kind>EXERCISE|CARRIED) (?P<id>\S+?)"
                    r"(?: \((?P<points>\d+) points?\))?(?:: (?P<task>\S.*))?\s*$")
_STUB = re.compile(r"^(?P<indent>[ \t]*)// STUB:(?: (?P<code>.*))?$")
_END = re.compile(r"^(?P<indent>[ \t]*)// END (?P<kind>EXERCISE|CARRIED) (?P<id>\S+)\s*$")
_LOOSE = re.compile(r"//\s*(BEGIN|END)\s+(EXERCISE|CARRIED)")
ID = re.compile(r"\d\d\.[a-z][a-z0-9_]*")


class MarkerError(ValueError):
    """An exercise or carried region is not well formed; the message names the file and line."""


@dataclass(frozen=True)
class Region:
    """One marked region of a .cu file. Line numbers are 0-based indices into its lines."""
    id: str
    indent: str
    begin: int          # the BEGIN line
    end: int            # the END line
    task: str           # the BEGIN line's task and the comment lines after it, joined
    task_lines: int     # BEGIN and its continuation lines
    body: tuple         # the code between the task and the STUB lines (or END): the solution,
    #                     or in an edition the student's code
    stub: tuple         # the stub's code lines ("// STUB: " removed, indentation kept); () where
    #                     the file is an edition, or a carried region takes its exercise's stub
    points: int = DEFAULT_POINTS  # "// BEGIN EXERCISE id (5 points): ..." gives fewer
    kind: str = EXERCISE          # or CARRIED: a later stage's copy of exercise `id`'s code

    @property
    def carried(self) -> bool:
        return self.kind == CARRIED

    @property
    def title(self) -> str:
        """The task's first clause: up to its first ':', ';' or '.' that ends a word, outside
        parentheses ("as it stands (hh = 0: row r0, ...)" keeps its parenthesis whole)."""
        depth = 0
        for i, ch in enumerate(self.task):
            depth += (ch == "(") - (ch == ")")
            if (depth <= 0 and ch in ":;." and i > 0 and not self.task[i - 1].isspace()
                    and (i + 1 == len(self.task) or self.task[i + 1].isspace())):
                return self.task[:i].strip()
        return self.task.strip()

    @property
    def unwritten(self) -> bool:
        """True while the region's code still holds the stub's TODO line."""
        return any(line.strip().startswith(TODO) for line in self.body)


def regions(text: str, where="kernel", solution=None) -> list:
    """The marked regions of a .cu file's text (exercise and carried), in order. MarkerError where
    they are not well formed: BEGIN without END (or the other way), nesting, another id or kind at
    END, a repeated id of one kind, markers at different indentations, STUB lines that are not all
    just before END, an empty solution, an exercise without a task. solution=True also requires
    an exercise's STUB lines (a solution edition); False forbids all STUB lines (an edition as
    handed out); None takes either."""
    lines = text.splitlines()
    found, seen, i = [], set(), 0

    def fail(n, why):
        raise MarkerError(f"{where}:{n + 1}: {why}")

    while i < len(lines):
        line = lines[i]
        if _END.match(line) or _STUB.match(line):
            fail(i, "STUB or END outside a region")
        m = _BEGIN.match(line)
        if not m:
            if _LOOSE.search(line):
                fail(i, f"not a well-formed marker: {line.strip()!r} (want '// BEGIN EXERCISE "
                        "NN.name: task', '// BEGIN CARRIED NN.name' or '// END EXERCISE NN.name')")
            i += 1
            continue
        rid, kind, indent, begin = m["id"], m["kind"], m["indent"], i
        name = f"{kind.lower()} {rid}" if kind == CARRIED else f"exercise {rid}"
        if not ID.fullmatch(rid):
            fail(i, f"exercise id {rid!r} is not NN.lower_case_name")
        if (kind, rid) in seen:
            fail(i, f"{name} is marked twice")
        seen.add((kind, rid))
        if kind == EXERCISE and not m["task"]:
            fail(i, f"BEGIN EXERCISE {rid} states no task ('// BEGIN EXERCISE {rid}: task')")
        task = [m["task"].strip()] if m["task"] else []
        i += 1
        while i < len(lines) and lines[i].startswith(indent + "//") and not (
                _BEGIN.match(lines[i]) or _STUB.match(lines[i]) or _END.match(lines[i])
                or lines[i].strip().startswith(TODO)):
            task.append(lines[i].strip()[2:].strip())
            i += 1
        task_lines = i - begin
        body, stub = [], []
        while True:
            if i >= len(lines):
                fail(begin, f"BEGIN {kind} {rid} has no END {kind} {rid}")
            line = lines[i]
            if _BEGIN.match(line):
                fail(i, f"BEGIN inside {name}")
            e = _END.match(line)
            if e:
                if (e["kind"], e["id"]) != (kind, rid):
                    fail(i, f"END {e['kind']} {e['id']} closes {name}")
                if e["indent"] != indent:
                    fail(i, f"END {kind} {rid} is not indented as its BEGIN")
                break
            s = _STUB.match(line)
            if s:
                if s["indent"] != indent:
                    fail(i, f"a STUB line of {name} is not indented as its BEGIN")
                stub.append(indent + s["code"] if s["code"] else "")
            elif stub:
                fail(i, f"code after the STUB lines of {name}: they must come last, before END")
            else:
                body.append(line)
            i += 1
        if solution is True:
            if kind == EXERCISE and not stub:
                fail(i, f"exercise {rid} has no STUB lines")
            if not any(ln.strip() for ln in body):
                fail(begin, f"{name} has no solution code")
            if stub and not stub[0].strip().startswith(TODO):
                fail(begin, f"the stub of {name} must start with a '{TODO} ...' line")
        if solution is False and stub:
            fail(i, f"{name} still has STUB lines: not an edition as handed out")
        found.append(Region(rid, indent, begin, i, " ".join(task), task_lines, tuple(body),
                            tuple(stub), int(m["points"] or DEFAULT_POINTS), kind))
        i += 1
    return found


def exercises_in(text: str, where="kernel") -> list:
    """The exercise regions (not carried ones) of a .cu file, in either form."""
    return [r for r in regions(text, where) if not r.carried]


def _join(lines, text):
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


def _reindent(lines, old, new):
    return [new + ln[len(old):] if ln.startswith(old) else ln for ln in lines]


def carried_task(rid, home=None) -> str:
    """The line an edition puts on a carried region's BEGIN marker that states none."""
    where = f" (kernels/{home}.cu)" if home else ""
    return (f"write your {rid} here too: the code you wrote in its own stage{where}, "
            "carried forward and fitted to the names here")


def edition_text(text: str, handed_out, stubs=None, homes=None, where="kernel") -> str:
    """A solution .cu file as an edition hands it out. Each region of an exercise in `handed_out`
    (ids), and each region carrying one, keeps its BEGIN, task and END and gets the stub's code
    in place of the solution; a carried region without STUB lines takes its exercise's stub
    (stubs: {id: stub lines}, re-indented), and its BEGIN line says to carry the student's code
    there and where it comes from (homes: {id: the exercise's stage slug}), its own words after.
    Every other region's markers are removed and its solution kept."""
    handed_out, stubs, homes = set(handed_out), stubs or {}, homes or {}
    lines = text.splitlines()
    out, last = [], 0
    for r in regions(text, where, solution=True):
        out += lines[last:r.begin]
        if r.id in handed_out:
            stub = list(r.stub)
            if not stub:
                if r.id not in stubs:
                    raise MarkerError(f"{where}:{r.begin + 1}: carried {r.id} has no STUB lines "
                                      f"and no exercise {r.id} gives it one")
                home = stubs[r.id]
                home_indent = re.match(r"[ \t]*", home[0]).group(0) if home else ""
                stub = _reindent(home, home_indent, r.indent)
            head = lines[r.begin:r.begin + r.task_lines]
            if r.carried:  # say what to do; the solution's own words about it follow
                head = [f"{r.indent}// BEGIN CARRIED {r.id}: {carried_task(r.id, homes.get(r.id))}"]
                head += [f"{r.indent}// ({r.task})"] if r.task else []
            out += head + stub + [lines[r.end]]
        else:
            out += list(r.body)
        last = r.end + 1
    return _join(out + lines[last:], text)


def student_text(text: str, where="kernel") -> str:
    """A solution .cu file with every exercise of its own handed out (its carried regions keep
    their code): each exercise region's solution and STUB lines become the stub's code."""
    own = {r.id for r in regions(text, where, solution=True) if not r.carried}
    carried = {r.id for r in regions(text, where) if r.carried}
    return edition_text(text, own - carried, where=where)


def strip_markers(text: str, where="kernel") -> str:
    """A .cu file without its markers: BEGIN, the task, STUB and END lines gone, the code between
    them left (the solution, or in an edition the stub or the student's code). It compiles to the
    same machine code (the markers are comments)."""
    lines = text.splitlines()
    drop = set()
    for r in regions(text, where):
        drop |= set(range(r.begin, r.begin + r.task_lines))
        drop |= set(range(r.end - len(r.stub), r.end + 1))
    return _join([ln for n, ln in enumerate(lines) if n not in drop], text)


def _code_only(line: str) -> str:
    """A line without its // comment and string contents, for counting brackets."""
    line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(?:\\.|[^'\\])*'", "''", line)
    return line.split("//")[0]


def unbalanced(body) -> str | None:
    """Why a region's code could reach outside its region (a bracket it closes that it did not
    open, or one it leaves open; a block comment), or None. A region's code is spliced into the
    stage's own file when it is graded: it may only fill its place."""
    depth = {"(": 0, "[": 0, "{": 0}
    close = {")": "(", "]": "[", "}": "{"}
    for n, line in enumerate(body, 1):
        if "/*" in line or "*/" in line:
            return f"line {n} of the region opens or closes a /* */ comment"
        if re.match(r"\s*#\s*(include|define|undef|if|endif|else|elif|pragma\s+once)\b", line):
            return f"line {n} of the region is a preprocessor directive other than #pragma unroll"
        for ch in _code_only(line):
            if ch in depth:
                depth[ch] += 1
            elif ch in close:
                depth[close[ch]] -= 1
                if depth[close[ch]] < 0:
                    return f"line {n} of the region closes a '{close[ch]}' it did not open"
    left = [k for k, v in depth.items() if v]
    return f"the region leaves '{left[0]}' open" if left else None


def splice(edition: str, mine: str, ids, where="kernel") -> str:
    """The edition's .cu text with the code of `mine` (a student's copy of the same file) in the
    regions of `ids` (exercise and carried regions alike); everything outside those regions comes
    from the edition. MarkerError where `mine` lacks one of those regions, or its code could
    reach outside its region (see unbalanced)."""
    ids = set(ids)
    theirs = {(r.kind, r.id): r for r in regions(mine, where)}
    lines = edition.splitlines()
    out, last = [], 0
    for r in regions(edition, f"{where} (as handed out)"):
        if r.id not in ids:
            continue
        got = theirs.get((r.kind, r.id))
        if got is None:
            raise MarkerError(f"{where}: the region '// BEGIN {r.kind} {r.id}' ... '// END "
                              f"{r.kind} {r.id}' is missing (keep the marker lines)")
        why = unbalanced(got.body)
        if why:
            raise MarkerError(f"{where}: {r.kind.lower()} {r.id}: {why}")
        out += lines[last:r.begin + r.task_lines] + _reindent(list(got.body), got.indent, r.indent)
        out.append(lines[r.end])
        last = r.end + 1
    return _join(out + lines[last:], edition)


# --- what counts as a region's solution text ---------------------------------------------------

_SCAFFOLD = re.compile(
    r"[{}()\s;]*"                                          # braces alone
    r"|#\s*pragma\s+unroll(\s+\d+)?"                       # unroll hints
    r"|(for|while)\s*\(.*\)\s*\{?"                         # a loop header, its body elsewhere
    r"|if\s*\(\s*\w+\s*(==|!=|<=|>=|<|>)\s*\w+\s*\)\s*\{?"     # one plain comparison
    r"|(const\s+)?[A-Za-z_][\w:<>]*\s+[A-Za-z_]\w*(\[\w*\])*\s*=\s*"
    r"(-?[\d.]+f?|0u|true|false|nullptr|-?INFINITY|\{[^}]*\})\s*;"  # a declaration = a constant
    r"|(else|break|continue|return|return\s+\w+)\s*;?")


def normalize(line: str) -> str:
    """A code line as the leak check compares it: its // comment dropped, whitespace collapsed."""
    return re.sub(r"\s+", " ", _code_only_keep_strings(line)).strip()


def _code_only_keep_strings(line: str) -> str:
    out, quote, i = [], None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            out.append(ch)
            if ch == "\\" and i + 1 < len(line):
                out.append(line[i + 1])
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
            out.append(ch)
        elif line.startswith("//", i):
            break
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def scaffold(line: str) -> bool:
    """True for a line that carries no solution on its own: braces, an unroll hint, a loop
    header, an `if` on one plain comparison, a declaration set to a constant, a bare return or
    break."""
    return bool(_SCAFFOLD.fullmatch(normalize(line)))


def solution_lines(region: Region, given="") -> list:
    """The lines of a region's solution that an edition handing it out must not show anywhere:
    its code lines, normalized, less scaffolding (see scaffold) and less those found in `given`
    (normalized text the student has anyway: the stage's own file outside its regions, the
    stages before it; see flat)."""
    out = []
    for line in region.body:
        n = normalize(line)
        if n and not scaffold(line) and n not in given and n not in out:
            out.append(n)
    return out


def fragments(line: str, given="", least=18) -> list:
    """The pieces of a normalized solution line between its `;`, `=`, `?` and `:` (an
    expression, a call with its arguments) of at least `least` characters and not in `given`:
    so that a quote of part of a line (a docstring citing its address arithmetic) is found too."""
    out = []
    for piece in re.split(r"[;?]|(?<![=!<>])=(?!=)|(?<!:):(?!:)", line):
        piece = piece.strip()
        if len(piece) >= least and piece not in given and piece != line and piece not in out:
            out.append(piece)
    return out


def flat(text: str) -> str:
    """Code as it counts as given: every line normalized (comments dropped), joined by newlines."""
    return "\n".join(normalize(line) for line in text.splitlines())


def plain(text: str) -> str:
    """Text as the leak check searches it: each line's whitespace collapsed, comments kept, so
    that a solution line is found inside a longer line (`const int q0 = ...` holds `q0 = ...`)
    or a comment quoting it, but never across two lines."""
    return "\n".join(re.sub(r"\s+", " ", line).strip() for line in text.splitlines())
