"""The CPU labs (flashlab.course.labs and labkeys), no GPU: each lab says right or wrong; a right
answer's message explains, a wrong one's never holds the answer; answers are read in any
reasonable form; the compiled keys survive JSON and hold no answer in the clear; labs.py, which
ships to students, computes nothing and imports no lesson model; and every lab's notebook asks
it in three cells whose solution is nowhere else and whose prose does not give it away."""
import ast
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from flashlab import paths
from flashlab.course import labdefs, labkeys, labs
from flashlab.course.nbtext import python_code
from conftest import load_tool

NOTEBOOKS = load_tool("notebooks")
PACKAGE = paths.ROOT / "flashlab"

# lab id: (right answers, in several forms; wrong answers; what the right message explains)
CASES = {
    "01.bank_wavefronts": ([16, "16", 16.0, np.int64(16)], [32, 1, 80, 7, 2],
                           ["banks 0 and 16", "16-way", "a broadcast", "81 floats"]),
    "02.sectors": ([5, " 5 "], [4, 32, 128, 1, 6], ["byte 16 to byte 143", "80% used",
                                                    "aligned, the same load touches 4"]),
    "03.occupancy": ([1, "1.0"], [4, 8, 32, 3, 2, 0], ["shared memory 1", "118 784 a block",
                                                       "registers allow 4"]),
    "05.fragment_owner": ([[30, 26, 22, 18, 14, 10, 6, 2], "2 6 10 14 18 22 26 30",
                           np.arange(2, 32, 4)], [[20, 21, 22, 23], [5], [1, 5, 9, 13, 17, 21,
                                                                          25, 29], [2, 6], [0]],
                          ["column 5 of tile 4", "lanes 4g + 2", "no shuffles"]),
    "06.bank_map": ([8], [4, 32, 1, 16, 2], ["2-way", "0, 8, 16, 24, 0, 8, 16, 24"]),
    "07.pipeline_period": ([700, "700 ns", 705.4, 686, 714.4], [300, 1000, 200, 500, 730, 350,
                                                                 685.4],
                           ["latency + load = 500 + 200 = 700", "Little's law"]),
    "09.descriptor": ([0x4000004004001580, "0x4000004004001580", "4611686293372409216"],
                      [0x4000004004001400, 0x15800, 0x1580, 0x4000040000401580, 0],
                      ["0x14000 + 3 x 2048 = 0x15800", "N-major"]),
    "10.parity": ([(1, 0, 3, 1), [1, 0, 3, 1], "1, 0, 3, 1", np.array([1, 0, 3, 1])],
                  [(1, 1, 3, 1), (1, 0, 3, 0), (1, 0, 2, 1), (0, 0, 0, 0)],
                  ["buffer 9 % 4 = 1", "parity (9 / 4) & 1 = 0", "into buffer 3"]),
    "11.registers": ([(96, 104), (96.0, "104")], [(96, 110), (128, 152), (96, 96), (100, 100)],
                     ["65 536 / 640 = 102.4", "110 each", "Four consumers do not fit"]),
    "12.store_sectors": ([(256, 2048, 1024)], [(64, 2048, 1024), (256, 1024, 1024),
                                               (128, 1024, 512), (256, 2048, 2048)],
                         ["4 x 64 = 256", "32 768 bytes"]),
    "13.lazy_bound": ([(1024, 8.807), (2 ** 10, np.log2(448)), (1024, 8.8), ("1024", "8.76")],
                      [(256, 8.8), (10, 8.8), (1024, 16), (1024, 9), (1024, 8), (512, 9)],
                      ["2^10 = 1 024", "2^8.807", "threshold of 8 or less"]),
    "98.merge": ([(0.25, 1.5, 0.5 + np.log(4)), ("0.25", 1.5, 1.886)],
                 [(0.5, 1.0, 1.886), (0.25, 1.5, 1.599), (0.25, 0.75, 1.886), (1, 6, 1.886)],
                 ["3/4 of the row", "0.5 + ln 4"]),
    "98.balance": ([(1.875, 0.5333), (1.88, 0.53)], [(1.75, 0.57), (1.88, 0.5), (8, 0.53),
                                                      (1, 1)],
                   ["7.5 for the last", "0.5 + 7 block times"]),
    "98.hide": ([(24000, 43), ("24000", 43.0)], [(20000, 52), (12000, 87), (24000, 44),
                                                  (2667, 393)],
                ["20 000 tokens", "24 000: the larger binds", "43.7"]),
}
# What each lab's answer looks like in prose: none of it may be in a wrong answer's message, nor
# in the lab's notebook's markdown.
TRUTH_TEXT = {
    "01.bank_wavefronts": ["16 wavefronts", "16-way"],
    "02.sectors": ["5 sectors"],
    "03.occupancy": ["1 block ", "1 block,", "1 block."],
    "05.fragment_owner": ["2, 6, 10", "4g + 2", "4 g + 2"],
    "06.bank_map": ["8 wavefronts for one ldmatrix.x4", "8 for the x4", "2-way"],
    "07.pipeline_period": ["700 ns", "700"],
    "08.tuning": [],   # filled from the recorded log
    "09.descriptor": ["0x4000004004001580", "4000004004001580", "0x15800"],
    "10.parity": ["(1, 0, 3, 1)", "1, 0, 3, 1"],
    "11.registers": ["(96, 104)", "96, 104", "96 registers"],
    "12.store_sectors": ["(256, 2048, 1024)", "2048, 1024", "2 048 sectors"],
    "13.lazy_bound": ["(1024, 8.8)", "8.807", "8.8 units", "2^10 = 1"],
    "98.merge": ["(0.250, 1.500", "0.25, 1.5", "1.886"],
    "98.balance": ["(1.88, 0.53)", "1.875", "0.533", "53 %", "53%"],
    "98.hide": ["24 000", "24000", "43 GPUs"],
}

# The same number with its unit where the notebook means something else, read and judged.
INNOCENT = {"06.bank_map": ["8 wavefronts for one phase"]}   # dense rows, one phase, not the x4


@pytest.fixture(autouse=True)
def fresh_keys(monkeypatch):
    """Keys compiled for each test (the tuning lab reads data/, which fixtures change), and never
    an edition's lab_keys.json lying in the checkout."""
    monkeypatch.setattr(labs, "KEYS_FILE", paths.ROOT / "no-such-lab_keys.json")
    monkeypatch.setattr(labs, "_keys", None)


def _switches_dropped(margin=3.0):
    from flashlab import tuning
    v = tuning.verdicts(labkeys._log()).xs((64, True), level=["D", "causal"])
    return sorted(v.index[v["off_vs_on_pct"] >= -margin])


def truth_text(id):
    if id == "08.tuning":
        off = _switches_dropped()
        return [", ".join(off), labdefs._join(off), str(off)]
    return TRUTH_TEXT[id]


def test_every_lab_has_cases():
    assert set(CASES) | {"08.tuning"} == {ex.id for ex in labs.LABS}
    assert all(ex.points == labs.POINTS == 2 for ex in labs.LABS)


@pytest.mark.parametrize("id", CASES)
def test_a_lab_says_right_or_wrong(id):
    rights, wrongs, why = CASES[id]
    for answer in rights:
        r = labs.answer_check(id, answer)
        assert (r.ok, r.score, r.exercise) == (True, 2.0, id), (answer, r)
        assert r.message.startswith("Right")
        for phrase in why:
            assert phrase in r.message, (phrase, r.message)
    for answer in wrongs:
        r = labs.answer_check(id, answer)
        assert (r.ok, r.score) == (False, 0.0), (answer, r)
        assert r.message.startswith("Wrong: you said ")


def _hints(id):
    """Every anticipated mistake of a lab, as an answer its form reads."""
    return list(labkeys.key(id).mistakes)


@pytest.mark.parametrize("id", [ex.id for ex in labs.LABS])
def test_a_wrong_answer_never_holds_the_truth(id, data_dir):
    key = labkeys.key(id)
    answers = _hints(id) + (CASES[id][1] if id in CASES else
                            [["FOLD_SCALE"], [], list(labdefs.SWITCH_NAMES)])
    hinted = 0
    form = labs.form(id)
    for answer in answers:
        r = labs.answer_check(id, answer)
        assert r.ok is False, (answer, r)
        said = f"Wrong: you said {form.said(form.canonical(answer))}."
        assert r.message.startswith(said)
        message = r.message[len(said):]       # what the student said is theirs to see
        assert not labkeys.leaks(id, message, key.right), (answer, r.message)
        for text in truth_text(id):
            assert text not in message, (text, r.message)
        hinted += any(h in r.message for h in key.mistakes.values())
    assert hinted >= len(key.mistakes) > 0     # each anticipated mistake gets its hint


def test_the_labs_answer_what_the_models_say(data_dir):
    from flashlab import banks, diagrams, fragments, tiling, tma_store, warpspec, wgmma
    assert labs.answer_check("01.bank_wavefronts", banks.wavefronts(np.arange(32) * 80)[0]).ok
    assert labs.answer_check("02.sectors", diagrams.sectors_per_request(
        16 + 4 * np.arange(32)).sectors).ok
    assert labs.answer_check("03.occupancy", tiling.occupancy(
        64, tiling.smem_bytes(128, 64, 64))["blocks"]).ok
    frag = fragments.to_fragment(np.arange(128).reshape(16, 8), "C") % 8
    assert labs.answer_check("05.fragment_owner", np.flatnonzero((frag == 5).any(1))).ok
    assert labs.answer_check("06.bank_map", fragments.ldmatrix_wavefronts(160).wavefronts).ok
    assert labs.answer_check("07.pipeline_period", diagrams.pipeline_period(200, 300, 2, 500)).ok
    assert labs.answer_check("08.tuning", _switches_dropped()).ok
    assert labs.answer_check("09.descriptor", wgmma.encode_descriptor(
        0x14000 + 3 * 2048, 128 * 128, 1024)).ok
    assert labs.answer_check("11.registers", (warpspec.entry_registers(640),
                                              warpspec.consumer_registers(4, 40))).ok
    req = tma_store.o_store_requests(256)
    assert labs.answer_check("12.store_sectors", (req.iloc[0].instructions, req.iloc[0].sectors,
                                                  req.iloc[1].sectors)).ok


def test_the_tuning_lab_reads_the_recorded_log(data_dir):
    truth = _switches_dropped()
    assert truth and len(truth) < len(labdefs.SWITCH_NAMES)
    r = labs.answer_check("08.tuning", truth)
    assert r.ok and "3 % rule" in r.message and "TFLOP/s all on" in r.message
    assert labs.answer_check("08.tuning", ", ".join(t.lower() for t in truth)).ok
    assert labs.answer_check("08.tuning", tuple(reversed(truth))).ok
    kept = next(s for s in labdefs.SWITCH_NAMES if s not in truth)
    r = labs.answer_check("08.tuning", truth + [kept])
    assert not r.ok and "off_vs_on_pct" in r.message
    r = labs.answer_check("08.tuning", ["FAST"])
    assert not r.ok and "not a switch" in r.message


def test_the_tuning_lab_is_skipped_without_a_log(empty_data_dir, capsys):
    r = labs.answer_check("08.tuning", [])
    assert r.ok is None and "no tuning log" in r.message
    assert labs.check("08.tuning", []) is None               # nothing to check: no error
    assert "08.tuning: SKIPPED." in capsys.readouterr().out
    assert labkeys.compile_keys("s")["labs"]["08.tuning"] == {"skipped": r.message}


def test_answers_are_read_in_any_reasonable_form():
    whole, lanes = labs.form("02.sectors"), labs.form("05.fragment_owner")
    assert {whole.canonical(x) for x in (32, "32", 32.0, np.int64(32), " 32 ", "32.0")} == {"32"}
    assert lanes.canonical([11, 8, 9, 10]) == lanes.canonical((8, 9, 10, 11)) == \
        lanes.canonical("8, 9, 10, 11, 8") == lanes.canonical(np.array([8, 9, 10, 11]))
    desc = labs.form("09.descriptor")
    assert desc.canonical(0x10) == desc.canonical("0x10") == desc.canonical(16.0)
    pair = labs.form("11.registers")
    assert pair.canonical((96, 104)) == pair.canonical([96.0, "104"]) == pair.canonical("96 104")
    sw = labs.form("08.tuning")
    assert sw.canonical([]) == sw.canonical("none") == sw.canonical(()) == ""
    assert sw.canonical(["one_kstep", "FOLD_SCALE"]) == sw.canonical("FOLD_SCALE, ONE_KSTEP")
    period = labs.form("07.pipeline_period")
    assert period.canonical("700 ns") == period.canonical(700.2) == "700"


@pytest.mark.parametrize("id,answer,says", [
    ("02.sectors", "lots", "whole number of sectors"),
    ("02.sectors", True, "whole number of sectors"),
    ("02.sectors", 4.5, "whole number of sectors"),
    ("03.occupancy", 3.35, "blocks are whole"),
    ("05.fragment_owner", [40], "lane numbers 0..31"),
    ("05.fragment_owner", [], "lane numbers 0..31"),
    ("07.pipeline_period", "fast", "a number of ns"),
    ("08.tuning", ["FAST"], "not a switch"),
    ("08.tuning", 3, "a list of switch names"),
    ("09.descriptor", -1, "0 <= value < 2**64"),
    ("10.parity", (1, 0, 3), "4 values, not 3"),
    ("11.registers", 104, "two whole numbers"),
    ("12.store_sectors", (1, 2, "x"), "a whole number"),
    ("13.lazy_bound", (1024,), "2 values, not 1"),
])
def test_an_answer_of_the_wrong_kind_says_what_is_wanted(id, answer, says, data_dir):
    r = labs.answer_check(id, answer)
    assert (r.ok, r.score) == (False, 0.0) and r.message.startswith("Wrong: ")
    assert says in r.message, r.message


@pytest.mark.parametrize("id", [ex.id for ex in labs.LABS])
def test_a_blank_answer_is_not_answered_not_wrong(id, data_dir):
    r = labs.answer_check(id, None)
    assert (r.ok, r.score, r.status) == (False, 0.0, "blank")
    assert r.message.startswith("not answered: set `answer` to ")
    with pytest.raises(labs.LabWrong, match="not answered"):
        labs.check(id, None)


def test_check_prints_a_right_answer_and_raises_on_a_wrong_one(capsys):
    assert labs.check("02.sectors", 5) is None    # no value: nbgrader would read it as a score
    assert capsys.readouterr().out.startswith("02.sectors: RIGHT. Right: 5 sectors")
    with pytest.raises(labs.LabWrong) as err:
        labs.check("02.sectors", 32)
    assert isinstance(err.value, AssertionError) and err.value.result.ok is False
    assert str(err.value).startswith("02.sectors: WRONG. Wrong: you said 32.")
    assert err.value._render_traceback_() == str(err.value).splitlines()
    assert capsys.readouterr().out == ""                      # the verdict is the error, once
    with pytest.raises(labs.LabWrong, match="whole number of sectors"):
        labs.check("02.sectors", "lots")


# ---------------------------------------------------------------- the compiled keys

SAMPLES = {id: rights[:1] + wrongs for id, (rights, wrongs, _) in CASES.items()}


def _verdicts(data):
    return {(id, repr(a)): (r.ok, r.message) for id, answers in SAMPLES.items() for a in answers
            for r in [labs._verdict(labdefs._lab_of(id), a, data)]}


def test_the_keys_survive_json_and_differ_by_salt(data_dir):
    keys = labkeys.compile_keys("salt-a")
    assert keys == labkeys.compile_keys("salt-a")             # deterministic for a salt
    assert keys["format"] == "flashlab-labkeys/1" and keys["salt"] == "salt-a"
    assert set(keys["labs"]) == {ex.id for ex in labs.LABS}
    text = json.dumps(keys)
    assert _verdicts(json.loads(text)) == _verdicts(keys)
    other = labkeys.compile_keys("salt-b")
    for id, entry in keys["labs"].items():
        assert set(entry) == {"right", "mistakes", "wrong"}
        assert not set(entry["right"]) & set(other["labs"][id]["right"])
        assert "{said}" in entry["wrong"]
        key = labkeys.key(id)
        assert len(entry["right"]) == len(key.right) and len(entry["mistakes"]) == len(
            key.mistakes)
    assert _verdicts(other) == _verdicts(keys)
    fresh = labkeys.compile_keys()
    assert fresh["salt"] != labkeys.compile_keys()["salt"]   # None: a fresh salt each time


def test_the_keys_hold_no_answer_in_the_clear(data_dir):
    text = json.dumps(labkeys.compile_keys("s"))
    for ex in labs.LABS:
        key = labkeys.key(ex.id)
        for canon, message in key.right.items():
            assert message not in text and message[:40] not in text
            if len(canon) > 6:                 # short ones turn up inside hashes by chance
                assert canon not in text, canon
        for hint in key.mistakes.values():
            assert hint not in text
    for phrases in TRUTH_TEXT.values():
        for phrase in phrases:
            if len(phrase) > 6:
                assert phrase not in text, phrase
    assert "Little's law" not in text and "Right:" not in text


def test_an_edition_reads_the_keys_from_json_without_labkeys(tmp_path, data_dir):
    out = labkeys.write_keys(tmp_path / "lab_keys.json", salt="edition")
    code = (f"import sys, pathlib\nimport flashlab.course.labs as L\n"
            f"L.KEYS_FILE = pathlib.Path({str(out)!r})\n"
            "assert L.keys()['salt'] == 'edition'\n"
            "assert L.answer_check('02.sectors', 5).ok\n"
            "assert L.answer_check('11.registers', (96, 110)).ok is False\n"
            "lessons = {'labkeys', 'fragments', 'diagrams', 'tiling', 'tuning', 'banks', "
            "'autotune', 'hopper_common', 'wgmma', 'tma', 'warpspec', 'tma_store', "
            "'lazy_rescale'}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[-1] in lessons))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=paths.ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"            # nothing computed, no model imported


def test_labs_py_imports_no_lesson_model_and_no_keys_at_module_level():
    banned = ("labkeys", "fragments", "diagrams", "tiling", "tuning", "banks", "autotune",
              "tables", "hopper_common", "wgmma", "tma", "warpspec", "tma_store", "lazy_rescale")
    for name in ("labs.py", "labdefs.py"):
        tree = ast.parse((PACKAGE / "course" / name).read_text())
        top = {(node.module or "") + ":" + ",".join(a.name for a in node.names)
               for node in tree.body if isinstance(node, ast.ImportFrom)}
        top |= {a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names}
        assert not [t for t in top if any(b in t for b in banned)], (name, top)
        inner = [(fn.name, a.name) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                 for node in ast.walk(fn) if isinstance(node, ast.ImportFrom)
                 for a in node.names]
        assert inner == ([("keys", "labkeys")] if name == "labs.py" else []), (name, inner)
    keys_src = ast.parse((PACKAGE / "course" / "labkeys.py").read_text())
    assert not [a.name for node in ast.walk(keys_src) if isinstance(node, ast.ImportFrom)
                for a in node.names if a.name == "labs"]          # no cycle through labs
    code = "import sys, flashlab.course.labs\nprint(sorted(sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=paths.ROOT)
    loaded = {m.split(".")[-1] for m in run.stdout.split("'") if m.startswith("flashlab")}
    assert not loaded & (set(banned) - {"tables"}), loaded   # tables: flashlab's own __init__


def test_labs_py_computes_no_truth():
    """No lesson model is called in what ships, nor does any answer stand in it."""
    for name in ("labs.py", "labdefs.py"):
        text = (PACKAGE / "course" / name).read_text()
        calls = {n.func.attr for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute)}
        assert not calls & {"encode_descriptor", "to_fragment", "sectors_per_request",
                            "occupancy", "wavefronts", "pipeline_period", "consumer_registers",
                            "verdicts", "entry_registers", "o_store_requests", "smem_bytes"}
        for phrases in TRUTH_TEXT.values():
            for phrase in phrases:
                if len(phrase) > 6:
                    assert phrase not in text, (name, phrase)


def test_the_prompts_quote_the_models():
    import torch
    from flashlab import diagrams, fragments, lazy_rescale, tiling, warpspec
    from flashlab.autotune import SWITCHES
    assert labdefs.WARP == fragments.WARP and labdefs.SECTOR == diagrams.SECTOR
    assert labdefs.SM90 == tiling.SM_LIMITS["9.0"] and labdefs.SM90[0] == warpspec.REGS_PER_SM
    assert labdefs.STAGE03_THREADS == tiling.THREADS
    assert labdefs.SWITCH_NAMES == tuple(SWITCHES)
    assert labdefs.E4M3_MAX == torch.finfo(torch.float8_e4m3fn).max
    from flashlab import ring
    assert labdefs.IB_GBS == ring.LINKS_GBS["ib_ndr"]
    assert lazy_rescale.LAZY_UNITS == 8 and "(8 in the kernel)" in labs.prompt("13.lazy_bound")
    assert "65 536" in labs.prompt("11.registers") and "233 472" in labs.prompt("03.occupancy")


def test_the_labkeys_parameters_are_the_prompts():
    """Each builder's parameters are what its prompt states."""
    p = {ex.id: labs.prompt(ex.id) for ex in labs.LABS}
    assert f"d = {labkeys.WAVE_D}" in p["01.bank_wavefronts"]
    assert f"{labkeys.SECTORS_OFFSET} bytes past a sector" in p["02.sectors"]
    assert f"{labkeys.OCC_REGISTERS} registers" in p["03.occupancy"]
    assert f"key {labkeys.OWNER_KEY}" in p["05.fragment_owner"]
    assert f"padded by {labkeys.BANK_PAD} bytes" in p["06.bank_map"]
    assert "500 ns later" in p["07.pipeline_period"] and "200 ns" in p["07.pipeline_period"]
    assert f"more than {labkeys.TUNE_MARGIN:g} %" in p["08.tuning"] and "causal" in p["08.tuning"]
    assert f"0x{labkeys.DESC_V0:x}" in p["09.descriptor"]
    assert f"STAGES = {labkeys.RING_STAGES}" in p["10.parity"]
    assert f"j = {labkeys.RING_TILE}" in p["10.parity"]
    assert f"CONSUMERS = {labkeys.REG_CONSUMERS} with PRODUCER_REGS = {labkeys.REG_PRODUCER}" \
        in p["11.registers"]
    assert f"D = {labkeys.STORE_D}" in p["12.store_sectors"]
    assert f"threshold to {labkeys.LAZY_THRESHOLD}" in p["13.lazy_bound"]
    assert "o_A = (1, 0) with log-sum-exp lse_A = 0.5" in p["98.merge"]
    assert "o_B = (0, 2) with lse_B = 0.5 + ln 3" in p["98.merge"]
    assert labkeys.MERGE == ((1.0, 0.0), 0.5, (0.0, 2.0), 0.5 + np.log(3))
    assert f"W = {labkeys.BALANCE_W} ranks" in p["98.balance"]
    assert f"{labkeys.HIDE['tflops']:g} TFLOP/s" in p["98.hide"] and "1 048 576" in p["98.hide"]
    assert labkeys.HIDE["tokens"] == 1048576


def test_the_lab_files_stay_short():
    for name in ("labs.py", "labkeys.py"):
        assert len((PACKAGE / "course" / name).read_text().splitlines()) < 850, name


# ---------------------------------------------------------------- the notebooks

def _notebook(ex):
    import nbformat
    path = next((paths.ROOT / "notebooks").glob(f"{ex.home}.ipynb"))
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize("ex", labs.LABS, ids=lambda ex: ex.id)
def test_a_lab_is_three_cells_in_its_notebook(ex, data_dir):
    for cells in (_notebook(ex).cells,
                  [dict(cell_type=k, source=s) for k, s in NOTEBOOKS.parse(
                      (paths.ROOT / "notebooks" / "src" / f"{ex.home}.py").read_text())]):
        at = [i for i, c in enumerate(cells) if f'labs.prompt("{ex.id}")' in c["source"]]
        assert len(at) == 1
        prompt, answer, check = (cells[at[0] + k] for k in range(3))
        assert prompt["cell_type"] == answer["cell_type"] == check["cell_type"] == "code"
        assert prompt["source"].splitlines()[-1] == f'print(labs.prompt("{ex.id}"))'
        assert set(prompt["source"].splitlines()[:-1]) <= {"from flashlab.course import labs"}
        lines = answer["source"].splitlines()
        assert lines[0] == "### BEGIN SOLUTION" and lines[-1] == "### END SOLUTION"
        assert any(line.startswith("answer = ") for line in lines)
        assert check["source"] == f'labs.check("{ex.id}", answer)'
        assert sum(f'"{ex.id}"' in c["source"] for c in cells) == 2   # prompt and check only
    nb = _notebook(ex)
    i = [i for i, c in enumerate(nb.cells) if f'labs.prompt("{ex.id}")' in c.source][0]
    assert nb.cells[i].outputs[0]["text"] == labs.prompt(ex.id) + "\n"   # outputs up to date
    assert nb.cells[i + 1].outputs == []
    printed, = nb.cells[i + 2].outputs
    assert printed["text"] in {f"{ex.id}: RIGHT. {m}\n" for m in labkeys.key(ex.id).right.values()}


def _solution_lines(ex):
    cells = _notebook(ex).cells
    i = [i for i, c in enumerate(cells) if f'labs.prompt("{ex.id}")' in c.source][0]
    inner = cells[i + 1].source.splitlines()[1:-1]
    return i + 1, [c for c in map(python_code, inner) if c]


def _shipped_texts(keys_json):
    """Everything an edition ships that a student reads, as (where, text): the package but the
    keys' source, the compiled keys, README and every notebook's cells and outputs."""
    import nbformat
    out = [(str(p.relative_to(paths.ROOT)), p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))
           if p.name != "labkeys.py"]
    out.append(("lab_keys.json", keys_json))
    out.append(("README.md", (paths.ROOT / "README.md").read_text()))
    for path in sorted((paths.ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for n, cell in enumerate(nb.cells):
            parts = [cell.source] + ["".join(o.get("text", "")) for o in cell.get("outputs", [])]
            out.append((f"{path.name}, cell {n}", "\n".join(parts)))
    return out


def test_no_solution_line_ships_anywhere(data_dir):
    texts = _shipped_texts(json.dumps(labkeys.compile_keys("s"), indent=1))
    srcs = {p.name: p.read_text() for p in (paths.ROOT / "notebooks" / "src").glob("*.py")}
    for ex in labs.LABS:
        cell, secrets = _solution_lines(ex)
        assert secrets
        own = f"{ex.home}.ipynb, cell {cell}"
        for where, text in texts:
            if where == own:
                continue
            lines = [re.sub(r"\s+", " ", ln).strip() for ln in text.splitlines()]
            for secret in secrets:
                assert not any(secret in ln for ln in lines), (ex.id, secret, where)
        for name, text in srcs.items():         # the percent sources: only the answer cell
            lines = [re.sub(r"\s+", " ", ln).strip() for ln in text.splitlines()]
            hits = [secret for secret in secrets for ln in lines if secret in ln]
            assert len(hits) == (len(secrets) if name == f"{ex.home}.py" else 0), (ex.id, name)


@pytest.mark.parametrize("ex", labs.LABS, ids=lambda ex: ex.id)
def test_a_labs_notebook_does_not_give_its_answer_away(ex, data_dir):
    """Not in the markdown, nor in an output the student sees before the lab: the answer, as
    its form renders it and as prose would write it."""
    nb = _notebook(ex)
    at = [i for i, c in enumerate(nb.cells) if f'labs.prompt("{ex.id}")' in c.source][0]
    key = labkeys.key(ex.id)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    before = "\n".join("".join(o.get("text", "")) + "".join(
        str(v) for v in o.get("data", {}).values() if isinstance(v, str))
        for c in nb.cells[:at] if c.cell_type == "code" for o in c.outputs)
    for where, text in (("markdown", markdown), ("outputs before the lab", before)):
        text = re.sub(r"\s+", " ", text)
        for innocent in INNOCENT.get(ex.id, ()):
            assert innocent in text or where != "markdown", innocent
            text = text.replace(innocent, "")
        assert not labkeys.leaks(ex.id, text, key.right, bare=False), (where, labkeys.leaks(
            ex.id, text, key.right, bare=False))
        for phrase in truth_text(ex.id):
            if phrase == "700" and where != "markdown":
                continue                        # timings in ns are everywhere in outputs
            assert phrase not in text, (where, phrase)


def test_a_count_may_carry_its_unit_and_a_blank_string_is_blank():
    """"5 sectors" is read as the 5 it counts (as "700 ns" is for a time), another unit is not;
    an empty or all-blank answer is not answered, not wrong."""
    assert labs.answer_check("02.sectors", "5 sectors").verdict == \
        labs.answer_check("02.sectors", 5).verdict == "right"
    assert labs.answer_check("02.sectors", "5 sector").verdict == "right"
    wrong = labs.answer_check("02.sectors", "5 bytes")
    assert wrong.verdict == "wrong" and "a whole number of sectors" in wrong.message
    assert labs.answer_check("07.pipeline_period", "700 ns").verdict == "right"
    for blank in ("", "   "):
        r = labs.answer_check("02.sectors", blank)
        assert r.verdict == "blank" and r.score == 0
