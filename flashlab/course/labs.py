"""The CPU labs: one predict-then-check question per notebook 01, 02, 03, 05-11, graded
on any machine. Each check computes the truth with the lesson models the notebook itself uses
(flashlab.banks, diagrams, tiling, fragments, tuning) and says right or wrong, and why.

In a notebook (nbgrader's markers; the student edition replaces the solution with
`# YOUR CODE HERE` / `raise NotImplementedError()`):

    from flashlab.course import labs
    print(labs.prompt("02.sectors"))

    ### BEGIN SOLUTION
    answer = 32
    ### END SOLUTION
    labs.check("02.sectors", answer)      # prints the verdict, returns the Result

`flashlab grade` reads the same cell from the notebook (grade_lab): it runs the code between the
markers (or, where the markers are gone, the cell's code above the `labs.check` call) in a fresh
namespace and checks the `answer` it leaves.
"""
import contextlib
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .. import diagrams as dg
from .. import fragments as fr
from .. import hopper as hp
from .. import cells, tables, tiling, tuning
from ..autotune import SWITCHES
from ..banks import BANK_BYTES, BANKS, wavefronts
from ..tables import NotRecorded
from . import Exercise, Result

POINTS = 2        # every lab
REL_TOL = 0.02    # a float answer within 2 % (or 1 unit) is right


class _Unreadable(ValueError):
    """The answer is not of the kind the question asks for; the message says what it wants."""


@dataclass(frozen=True)
class Lab:
    exercise: Exercise
    prompt: str                                # the question as the notebook shows it
    check: Callable[[Exercise, object], Result]


def _result(ex, ok, message) -> Result:
    return Result(ex.id, bool(ok), float(ex.points if ok else 0), message)


def _whole(answer, what="a whole number") -> int:
    if isinstance(answer, (bool, np.bool_)):
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    if isinstance(answer, (int, np.integer)):  # exactly, even past 2**53 (a 64-bit descriptor)
        return int(answer)
    if isinstance(answer, str) and re.fullmatch(r"\s*0[xX][0-9a-fA-F]+\s*", answer):
        return int(answer, 16)
    if isinstance(answer, str):
        answer = answer.strip()
        if not re.fullmatch(r"[+-]?\d+(\.0*)?", answer):
            raise _Unreadable(f"the answer is {what}, not {answer!r}")
        answer = float(answer)
    try:
        x = float(answer)
    except (TypeError, ValueError):
        raise _Unreadable(f"the answer is {what}, not {answer!r}") from None
    if not math.isfinite(x) or x != round(x):
        raise _Unreadable(f"the answer is {what}, not {answer!r}")
    return int(round(x))


def _number(answer) -> float:
    if isinstance(answer, (bool, np.bool_)):
        raise _Unreadable(f"the answer is a number, not {answer!r}")
    if isinstance(answer, str):
        answer = re.sub(r"\s*(ns|nanoseconds?)\s*$", "", answer.strip(), flags=re.I)
    try:
        x = float(answer)
    except (TypeError, ValueError):
        raise _Unreadable(f"the answer is a number, not {answer!r}") from None
    if not math.isfinite(x):
        raise _Unreadable(f"the answer is a finite number, not {answer!r}")
    return x


def close(x, truth, rel=REL_TOL, abs_=1.0) -> bool:
    """A float answer's tolerance: within `rel` of the truth, or `abs_` units of it."""
    return abs(x - truth) <= max(rel * abs(truth), abs_)


def _plural(n, word):
    return f"{n} {word}" + ("s" if n != 1 else "")


def _n(x) -> str:
    """12345 -> '12 345', as the notebooks write numbers."""
    return f"{x:,}".replace(",", " ")


def _join(xs):
    xs = [str(x) for x in xs]
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


# ---------------------------------------------------------------- 01: bank wavefronts

WAVE_D = 64


def _qi_words(d, x=0):
    """The 4-byte words the warp's 32 lanes read in stage 01's `Qi[t*d + x]`."""
    return np.arange(32) * d + x


def _bank_wavefronts(ex, answer):
    words = _qi_words(WAVE_D)
    cost = wavefronts(words)[0]
    banks_hit = sorted(set((words % BANKS).tolist()))
    padded = wavefronts(_qi_words(WAVE_D + 1))[0]
    kj = wavefronts(np.zeros(32, dtype=int))[0]           # Kj[y*d + x]: one word for every lane
    where = (f"bank {banks_hit[0]}" if len(banks_hit) == 1 else
             f"banks {_join(banks_hit)}")
    why = (f"Lane t reads word {WAVE_D}·t + x (byte {4 * WAVE_D}·t + 4x), in bank "
           f"({WAVE_D}·t + x) mod {BANKS} = x mod {BANKS}, since {WAVE_D} is a multiple of "
           f"{BANKS}: at x = 0 all 32 lanes are in {where}, at 32 different words, and a bank "
           f"delivers one word a clock: {cost} wavefronts, a {cost}-way conflict.")
    n = _whole(answer, "a whole number of wavefronts")
    if n == cost:
        return _result(ex, True, f"Right: {cost} wavefronts. " + why + f" The same warp's read "
                       f"of Kj[y*d + x] is one word for all lanes, a broadcast: {kj}. Rows of "
                       f"d + 1 = {WAVE_D + 1} floats would put lane t in bank t: {padded} "
                       f"wavefront; padding the rows is how stage 03 removes its conflicts.")
    hint = ""
    if n == kj:
        hint = (f" {kj} wavefront needs the 32 words in 32 different banks (consecutive words, "
                f"or rows {WAVE_D + 1} floats apart), or one word for every lane (a broadcast, "
                "like Kj[y*d + x]); here 32 different words share one bank.")
    elif n == WAVE_D:
        hint = (f" {WAVE_D} is d, the lanes' stride in words; a wavefront count is how many "
                "different words the busiest bank must deliver: one per lane here.")
    elif n == 32 * BANK_BYTES // dg.SECTOR:
        hint = (" 4 would be a global-memory count (128 consecutive bytes in 32-byte sectors); "
                "shared memory is served by banks, one word per bank per clock.")
    elif n == 32 * WAVE_D:
        hint = (f" {32 * WAVE_D} is how often the warp executes this read in one visit "
                f"(32 keys × {WAVE_D} dims); the question asks about one read.")
    elif n == 32 * BANK_BYTES:
        hint = " That counts bytes; the question counts wavefronts (passes through the banks)."
    elif 1 < n < cost:
        hint = (f" Fewer than {cost} passes would need lanes sharing a word, or the words spread "
                "over more banks; here every lane has its own word, all in one bank.")
    return _result(ex, False, f"Wrong: you said {n}. " + why + hint)


# ---------------------------------------------------------------- 02: sectors per request

SECTORS_D = 64


def _sectors(ex, answer):
    addr = dg.warp_addresses("01_naive", D=SECTORS_D, step=0)
    req = dg.sectors_per_request(addr)
    stride = int(addr[1] - addr[0])
    coalesced = dg.sectors_per_request(dg.warp_addresses("02_coalesced", D=SECTORS_D)).sectors
    n = _whole(answer, "a whole number of sectors")
    asked = len(addr) * 4
    why = (f"lane t reads byte {stride}·t, so lane 0 reads byte 0 and lane 1 byte {stride}: rows "
           f"are {SECTORS_D} × 4 = {stride} bytes apart, more than a {dg.SECTOR}-byte sector, so "
           f"each lane touches its own sector: {req.sectors}. They move "
           f"{_n(req.sectors * dg.SECTOR)} bytes for the {asked} the lanes asked for "
           f"({req.efficiency:.1%} used).")
    if n == req.sectors:
        return _result(ex, True, f"Right: {req.sectors} sectors: " + why + f" Stage 02's load "
                       f"reads {asked} consecutive bytes: {coalesced} sectors.")
    hint = ""
    if n == coalesced:
        hint = (f" {coalesced} is stage 02's count, where consecutive lanes read consecutive "
                f"floats ({asked} neighbouring bytes = {coalesced} sectors); stage 01's lanes "
                "read down a column.")
    elif n == 1:
        hint = " A sector holds 8 floats, but only 8 neighbouring ones."
    elif n in (asked, req.sectors * dg.SECTOR):
        hint = " That counts bytes; the question counts 32-byte sectors."
    return _result(ex, False, f"Wrong: you counted {n}; " + why + hint)


# ---------------------------------------------------------------- 03: occupancy

OCC_REGISTERS, OCC_THREADS, OCC_CC = 64, tiling.THREADS, "9.0"
RECORDED_REGISTERS = 120   # what ptxas gives stage 03 at D = 64 for sm_90 (notebook 03, section 6)


def _occupancy(ex, answer):
    smem = tiling.smem_bytes()
    occ = tiling.occupancy(OCC_REGISTERS, smem, OCC_THREADS, OCC_CC)
    lim, blocks = occ["limits"], occ["blocks"]
    regs_sm, _, _, smem_sm = tiling.SM_LIMITS[OCC_CC]
    per_block_regs = math.ceil(OCC_REGISTERS * 32 / 256) * 256 * (OCC_THREADS // 32)
    decides = [name for name, v in lim.items() if v == blocks]
    detail = (f"registers allow {lim['registers']} ({OCC_REGISTERS} × {OCC_THREADS} = "
              f"{_n(per_block_regs)} a block, {_n(regs_sm)} // {_n(per_block_regs)}), threads "
              f"{lim['threads']}, the block limit {lim['blocks']}, and shared memory "
              f"{lim['shared memory']} ({_n(smem)} + 1 024 reserved = {_n(smem + 1024)} bytes a "
              f"block, {_n(smem_sm)} // {_n(smem + 1024)})")
    try:
        n = _whole(answer, "a whole number of blocks")
    except _Unreadable:
        x = _number(answer)  # a fraction: the student divided without rounding down
        return _result(ex, False, f"Wrong: blocks are whole, and a block that does not fit is "
                       f"not resident: {x:g} rounds down. The SM holds {blocks}: {detail}.")
    if n == blocks:
        recorded = tiling.occupancy(RECORDED_REGISTERS, smem, OCC_THREADS, OCC_CC)
        return _result(ex, True, f"Right: {blocks} blocks ({occ['warps']} warps, "
                       f"{occ['occupancy']:.1%} occupancy). Each limit counts: {detail}; the "
                       f"smallest, {_join(decides)}, decides. At the ~{RECORDED_REGISTERS} "
                       f"registers stage 03 really uses, registers decide instead: "
                       f"{recorded['blocks']} blocks.")
    hint = ""
    alone = [name for name, v in lim.items() if v == n]
    if alone:
        hint = (f" {n} is what the {_join(alone)} limit alone allows; a block must fit every "
                f"limit at once, so the smallest one ({_join(decides)}) decides.")
    elif n == tiling.occupancy(RECORDED_REGISTERS, smem, OCC_THREADS, OCC_CC)["blocks"]:
        hint = (f" {n} is what {RECORDED_REGISTERS} registers a thread allow (the recorded "
                f"kernel); at {OCC_REGISTERS} registers that limit moves.")
    return _result(ex, False, f"Wrong: you said {n}; the SM holds {blocks}, the least of what "
                   f"each limit allows: {detail}.{hint}")


# ---------------------------------------------------------------- 05: fragment ownership

OWNER_ROW = 10


def _lanes(answer) -> list:
    if isinstance(answer, str):
        parts = [p for p in re.split(r"[\s,;]+", answer.strip("[](){} ")) if p]
    elif np.ndim(answer) == 0:
        parts = [answer]
    else:
        parts = list(np.asarray(answer).ravel().tolist())
    lanes = [_whole(p, "a list of lane numbers (0..31)") for p in parts]
    if not lanes or any(not 0 <= x < fr.WARP for x in lanes):
        raise _Unreadable(f"the answer is a list of lane numbers 0..31, not {answer!r}")
    return sorted(set(lanes))


def _owner(ex, answer):
    shape = fr.FRAGMENTS["C"][1]
    S = np.arange(shape[0] * shape[1]).reshape(shape)     # S[r, c] = 8 r + c: a value says where
    frag = fr.to_fragment(S, "C")                          # the warp emulation: (32 lanes, c0..c3)
    rows, cols = frag // shape[1], frag % shape[1]
    truth = sorted(np.flatnonzero((rows == OWNER_ROW).any(axis=1)).tolist())
    g = OWNER_ROW % 8
    holds = {lane: [(f"c{i}", int(cols[lane, i])) for i in range(frag.shape[1])
                    if rows[lane, i] == OWNER_ROW] for lane in truth}
    elems = sorted({e for v in holds.values() for e, _ in v})
    why = (f"C's rule puts row groupID in c0, c1 and row groupID + 8 in c2, c3, groupID = "
           f"lane >> 2; row {OWNER_ROW} = {g} + {OWNER_ROW - g}, so groupID {g}: the quad of lanes "
           f"{truth[0]}-{truth[-1]}, {'/'.join(elems)} each (lane {truth[0]} + t holds columns 2t "
           f"and 2t + 1).")
    mine = _lanes(answer)
    if mine == truth:
        return _result(ex, True, f"Right: lanes {_join(truth)}. " + why + " So the row's max and "
                       "sum take two shfl_xor inside the quad (masks 1 and 2: "
                       "fragments.quad_reduce) and no shared memory.")
    notes = []
    for lane in [x for x in mine if x not in truth][:3]:
        held = sorted({int(r) for r in rows[lane]})
        notes.append(f"lane {lane} (groupID {lane >> 2}) holds rows {_join(held)}, not "
                     f"{OWNER_ROW}")
    missing = [x for x in truth if x not in mine]
    if missing:
        notes.append(f"you left out {_join(missing)}: " + "; ".join(
            f"lane {lane} holds " + ", ".join(f"S[{OWNER_ROW}][{c}] in {e}" for e, c in holds[lane])
            for lane in missing[:2]))
    if len(mine) == 1:
        notes.append(f"one lane holds only {len(holds[truth[0]])} of the row's {shape[1]} "
                     "elements: four lanes share a row")
    return _result(ex, False, f"Wrong: you said lanes {_join(mine)}; " + "; ".join(notes)
                   + ". " + why)


# ---------------------------------------------------------------- 06: a bank map

BANK_D, BANK_PAD = 64, 32


def _bank_map(ex, answer):
    row_bytes = 2 * BANK_D + BANK_PAD
    cost = fr.ldmatrix_wavefronts(row_bytes)
    first = [int(fr.smem_offset(r, 0, row_bytes)) // BANK_BYTES % BANKS for r in range(8)]
    groups = {}
    for r, b in enumerate(first):
        groups.setdefault(b, []).append(r)
    shared = [rows for rows in groups.values() if len(rows) > 1]
    per_row = row_bytes // BANK_BYTES % BANKS
    why = (f"Row r starts at byte {row_bytes}·r, bank {row_bytes // BANK_BYTES}·r mod {BANKS} = "
           f"{per_row}·r mod {BANKS}: the first chunks of rows 0-7 start in banks "
           f"{', '.join(map(str, first))}. ")
    if shared:
        b = first[shared[0][0]]
        why += (f"Rows {' and '.join(map(str, shared[0]))} both start in bank {b} (banks "
                f"{b}-{b + 3}), and so on for the other rows, so each 8-row phase is "
                f"{cost.ways}-way: {cost.ways} wavefronts a phase, {cost.wavefronts} for the x4 (ideal {cost.ideal}).")
    else:
        why += f"All 8 rows land in different bank groups: {cost.wavefronts} wavefronts."
    n = _whole(answer, "a whole number of wavefronts")
    if n == cost.wavefronts:
        return _result(ex, True, f"Right: {cost.wavefronts} wavefronts, {cost.ways}-way. " + why
                       + f" Padding by 16 bytes moves a row by 4 banks, so 8 rows cover all 32: "
                       f"{fr.ldmatrix_wavefronts(2 * BANK_D + 16).wavefronts} wavefronts; the XOR "
                       f"swizzle gets {fr.ldmatrix_wavefronts(2 * BANK_D, swizzle=True).wavefronts}"
                       " with no padding at all.")
    hint = ""
    if n == cost.ideal:
        hint = (f" {cost.ideal} needs the 8 rows of a phase in 8 different 4-bank groups; "
                f"{BANK_PAD} bytes of padding move a row by {BANK_PAD // BANK_BYTES} banks, so "
                f"the rows come back to bank 0 after {BANKS // (BANK_PAD // BANK_BYTES)}.")
    elif n == fr.ldmatrix_wavefronts(2 * BANK_D).wavefronts:
        hint = (f" {n} is the dense {2 * BANK_D}-byte layout, where every row starts in bank 0 "
                "(8-way); the padding does spread the rows, only not over all 32 banks.")
    return _result(ex, False, f"Wrong: you said {n}; " + why + hint)


# ---------------------------------------------------------------- 07: the pipeline timeline

PIPE_LOAD, PIPE_COMPUTE, PIPE_LATENCY, PIPE_STAGES = 200.0, 300.0, 500.0, 2


def _pipeline(ex, answer):
    L, C, lat, k = PIPE_LOAD, PIPE_COMPUTE, PIPE_LATENCY, PIPE_STAGES
    period = dg.pipeline_period(L, C, k, lat)
    sched = dg.pipeline_schedule(L, C, tiles=8, stages=k, latency=lat)
    starts = sched["compute_start"].to_numpy()
    assert close(starts[-1] - starts[-2], period, 1e-9, 1e-9), "schedule and period disagree"
    serial = dg.pipeline_period(L, C, 1, lat)
    need = dg.pipeline_stages_needed(L, C, lat)
    three = dg.pipeline_period(L, C, 3, lat)
    timeline = (f"pipeline_schedule({L:g}, {C:g}, stages={k}, latency={lat:g}) starts the math of "
                f"tiles 0-3 at {', '.join(f'{s:g}' for s in starts[:4])} ns: {period:g} ns apart.")
    why = (f"The tile issued one ahead (when tile j's math starts) needs latency + load = "
           f"{lat:g} + {L:g} = {lat + L:g} ns to arrive, longer than the {C:g} ns of math and "
           f"the {L:g} ns of the link, so the loop waits for it: the period is max({C:g}, {L:g}, "
           f"({lat:g} + {L:g}) / ({k} - 1)) = {period:g} ns. " + timeline)
    x = _number(answer)
    if close(x, period):
        return _result(ex, True, f"Right: {period:g} ns a tile. " + why + f" That is Little's law: "
                       f"{lat + L:g} ns of latency and transfer must be covered by tiles in "
                       f"flight; three buffers give {three:g} ns, and {need} make it "
                       f"compute-bound ({C:g} ns; pipeline_stages_needed).")
    hint = ""
    if close(x, C):
        hint = (f" {C:g} ns (the math alone) would hold if the tile issued one ahead arrived "
                f"within {C:g} ns; it needs {lat + L:g}.")
    elif close(x, serial):
        hint = f" {serial:g} ns is stage 06's period, one buffer, nothing overlapped."
    elif close(x, L):
        hint = f" {L:g} ns is the link alone; the latency comes on top for a tile issued late."
    elif close(x, max(L + C, lat)):
        hint = " The latency overlaps the previous tile's math; it is not added to it."
    return _result(ex, False, f"Wrong: you said {x:g} ns; the period is {period:g}. " + why + hint)


# ---------------------------------------------------------------- 08: a tuning decision

TUNE_D, TUNE_CAUSAL = 64, False


def _switch_names(answer) -> set:
    names = list(SWITCHES)
    if answer is None:
        return set()
    if isinstance(answer, str):
        parts = [p for p in re.split(r"[\s,;]+", answer.strip("[](){} ")) if p]
        if [p.lower() for p in parts] in (["none"], ["nothing"]):
            parts = []
    else:
        try:
            parts = list(answer)
        except TypeError:
            raise _Unreadable(f"the answer is a list of switch names, not {answer!r}") from None
    out = set()
    for p in parts:
        name = str(p).strip().strip("'\"").upper()
        if name not in names:
            raise _Unreadable(f"{p!r} is not a switch; the switches are {', '.join(names)}")
        out.add(name)
    return out


def _log():
    """The tuning log of the GPU shown, else the one with the most rows recorded, else None."""
    try:
        return tables.tune_log()
    except NotRecorded:
        df = tables.TUNE08.load()
        if df.empty:
            return None
        return tables.tune_log(df["gpu"].value_counts().index[0])


def _tuning(ex, answer):
    log = _log()
    if log is None:
        return Result.skipped(ex, "no tuning log recorded (data/tune08.csv): run `flashlab tune` "
                              "on a GPU first")
    gpu = log["gpu"].iloc[0]
    chosen = tuning.choice(log)[(TUNE_D, TUNE_CAUSAL)]
    off = {name for name, bit in SWITCHES.items() if not chosen[-1] & bit}
    v = tuning.verdicts(log).xs((TUNE_D, TUNE_CAUSAL), level=["D", "causal"])

    def line(name):
        r = v.loc[name]
        if r["without"] != r["without"]:
            return (f"{name}: not timed off (nothing to skip without a mask), so it stays on")
        verdict = "off won: dropped" if name in off else "off lost: kept"
        return (f"{name}: {r['all_on']:.1f} TFLOP/s all on, {r['without']:.1f} without "
                f"({r['off_vs_on_pct']:+.1f} %): {verdict}")

    rule = ("the autotune keeps a switch only where switching it off lost (over the N its shape "
            "serves)")
    where = f"D = {TUNE_D}, {'causal' if TUNE_CAUSAL else 'non-causal'}, log recorded on {gpu}"
    table = "; ".join(line(name) for name in SWITCHES)
    mine = _switch_names(answer)
    said = _join(sorted(mine)) if mine else "none"
    truth = _join(sorted(off)) if off else "none"
    if mine == off:
        return _result(ex, True, f"Right: it turns off {truth} ({where}); {rule}. {table}.")
    wrong = [line(n) for n in sorted(mine - off)] + [line(n) for n in sorted(off - mine)]
    return _result(ex, False, f"Wrong: you said {said}; it turns off {truth} ({where}); {rule}. "
                   + "; ".join(wrong) + ".")


# ---------------------------------------------------------------- 09: a wgmma descriptor

DESC_V0, DESC_BC, DESC_KS = 0x14000, 128, 3   # a V tile's shared address, its keys, the k-step


def _descriptor(ex, answer):
    start = DESC_V0 + DESC_KS * 16 * 128
    lead, stride = DESC_BC * 128, 1024
    truth = hp.encode_descriptor(start, lead, stride)
    why = (f"k-step {DESC_KS} of P·V reads keys {16 * DESC_KS}-{16 * DESC_KS + 15}: 16 rows of 128 "
           f"bytes each per k-step, so the start is 0x{DESC_V0:x} + {DESC_KS} x 2048 = 0x{start:x}; V is "
           f"read transposed (N-major), so the leading byte offset is the distance between its "
           f"64-column blocks, {DESC_BC} rows x 128 = {lead} bytes, and the stride byte offset is "
           f"8 rows, 1024 bytes; swizzle mode 1 (128-byte). Each field is its bytes >> 4: "
           f"{hp.decode_descriptor(truth)}.")
    x = _whole(answer, "a 64-bit descriptor (an int)")
    if x == truth:
        return _result(ex, True, f"Right: 0x{truth:016x}. " + why)
    hint = ""
    try:
        got = hp.decode_descriptor(x)
    except ValueError:
        got = None
    if got is not None:
        if got["start_address"] == DESC_V0:
            hint = " Your start address is the tile's; k-step 3 starts 3 x 16 keys further."
        elif (got["leading_byte_offset"], got["stride_byte_offset"]) == (stride, lead):
            hint = (" Your leading and stride offsets are swapped: for an N-major operand the "
                    "leading offset jumps between 64-column blocks.")
        elif got["swizzle"] != 1:
            hint = " The tile is 128-byte swizzled: mode 1 in bits 62-63."
    elif x == start or x == (start >> 4):
        hint = " That is only the start address; the descriptor packs four fields into 64 bits."
    return _result(ex, False, f"Wrong: you said 0x{x:x}; the descriptor is 0x{truth:016x}. " + why + hint)


# ---------------------------------------------------------------- 10: the ring's parities

RING_STAGES, RING_TILE = 3, 7


def _parity(ex, answer):
    S, j = RING_STAGES, RING_TILE
    nxt = j + S - 2
    truth = (j % S, (j // S) & 1, nxt % S, (nxt // S - 1) & 1)
    why = (f"Tile {j} is in buffer {j} % {S} = {truth[0]}; it is that buffer's round {j // S} "
           f"(rounds 0, 1, 2, ...), and full[b] completes once a round, so the consumers wait for "
           f"parity ({j} / {S}) & 1 = {truth[1]}. At iteration {j} the elected thread loads tile "
           f"{j} + {S - 2} = {nxt} into buffer {truth[2]}, whose last tile, {nxt - S}, must be "
           f"released first: the empty barrier's completion number {nxt // S - 1}, parity "
           f"{truth[3]}.")
    try:
        got = tuple(int(v) for v in answer)
    except (TypeError, ValueError):
        return _result(ex, False, "Set `answer` to four whole numbers: (buffer, full parity, "
                                  "refill buffer, empty parity).")
    if got == truth:
        return _result(ex, True, f"Right: {truth}. " + why)
    hint = ""
    if len(got) == 4 and got[1] == (j % 2):
        hint = " The parity counts rounds of the ring (tile / STAGES), not tiles."
    elif len(got) == 4 and got[3] == (nxt // S) & 1:
        hint = (" The refill waits for the release of the tile that held the buffer before, one "
                "round earlier: (next / STAGES - 1) & 1.")
    return _result(ex, False, f"Wrong: you said {got}; it is {truth}. " + why + hint)


# ---------------------------------------------------------------- 11: registers per role

REG_CONSUMERS, REG_PRODUCER = 3, 40    # three consumer warpgroups; the producer keeps 40


def _registers(ex, answer):
    c, prod = REG_CONSUMERS, REG_PRODUCER
    threads = 128 * (1 + c)
    entry = hp.entry_registers(threads)
    cons = hp.consumer_registers(c, prod)
    truth = (entry, cons)
    pool = entry * (1 + c)
    exact = (pool - prod) / c
    need = sum(hp.accumulator_registers(128, 128).values())
    sm = _n(hp.REGS_PER_SM)
    why = (f"A block of {1 + c} warpgroups is {threads} threads; under "
           f"__launch_bounds__({threads}, 1) one block must fit the {sm} registers: {sm} / "
           f"{threads} = {hp.REGS_PER_SM / threads:g}, rounded down to a multiple of 8: {entry}. "
           f"setmaxnreg moves registers only within the block, so each thread position of a "
           f"warpgroup has {1 + c} x {entry} = {pool} registers to share: the producer keeps "
           f"{prod}, the {c} consumers share {pool - prod}: {exact:.1f} each, down to a multiple "
           f"of 8: {cons} (the kernel's (ENTRY_REGS * (1 + CONSUMERS) - PRODUCER_REGS) / "
           f"CONSUMERS / 8 * 8).")
    try:
        got = tuple(_whole(v, "a whole number of registers") for v in answer)
    except TypeError:
        return _result(ex, False, "Set `answer` to two whole numbers: (registers a thread at "
                                  "launch, registers a consumer thread after setmaxnreg).")
    if got == truth:
        return _result(ex, True, f"Right: {truth}. " + why + f" {cons} is fewer than the {need} "
                       "registers a consumer's accumulators take at D = 128 (O 64, S 64, P 32): "
                       "ptxas would serialize the wgmma, which is why the kernel runs two "
                       "consumers.")
    hint = ""
    if len(got) == 2 and got[1] == int(exact):
        hint = " setmaxnreg takes multiples of 8: round the share down."
    elif len(got) == 2 and got[1] == hp.consumer_registers(2, prod):
        hint = f" {got[1]} is the share of two consumers; here three share it."
    elif len(got) == 2 and got[0] == hp.entry_registers(128 * 3):
        hint = (f" {got[0]} is the cap of a 384-thread block (two consumers); this one has "
                f"{threads}.")
    elif len(got) == 2 and got[1] == hp.REGS_PER_SM // threads:
        hint = " That splits the registers evenly; setmaxnreg moves them from the producer."
    return _result(ex, False, f"Wrong: you said {got}; it is {truth}. " + why + hint)


STORE_D = 128  # the head dim of lab 12.store_sectors


def _store_sectors(ex, answer):
    req = hp.o_store_requests(STORE_D)
    s11, s12 = req.iloc[0], req.iloc[1]
    truth = (int(s11.instructions), int(s11.sectors), int(s12.sectors))
    per_thread = STORE_D // 4
    why = (f"Each thread holds 2 rows x {STORE_D // 8} tiles of 8 columns, 4 bytes of each: "
           f"{per_thread} stores a thread, so the warpgroup's 4 warps issue 4 x {per_thread} = "
           f"{truth[0]} warp instructions. One of them writes 16 bytes in each of 8 rows "
           f"({2 * STORE_D} bytes apart): 8 sectors, each half used, {truth[1]} in all. The TMA "
           f"writes the 64 x {STORE_D} x 2 = {64 * STORE_D * 2:,} bytes as whole sectors: "
           f"{truth[2]}, half as many.")
    try:
        got = tuple(_whole(v, "a whole number") for v in answer)
    except TypeError:
        return _result(ex, False, "Set `answer` to three whole numbers: (warp store "
                                  "instructions, sectors from registers, sectors by the TMA).")
    if got == truth:
        return _result(ex, True, f"Right: {truth}. " + why)
    hint = ""
    if len(got) == 3 and got[0] == per_thread:
        hint = f" {per_thread} is one thread's count; a warp instruction is issued per warp."
    elif len(got) == 3 and got[1] == truth[0] * 4:
        hint = " A 16-byte piece of a row lies in one 32-byte sector, and 8 rows are 8 sectors."
    elif len(got) == 3 and got[1] == truth[2]:
        hint = " That counts sectors as if each were written once, full; each instruction sends its own."
    return _result(ex, False, f"Wrong: you said {got}; it is {truth}. " + why + hint)


LAZY_UNITS = hp.LAZY_UNITS  # stage 13's threshold: a score may exceed the running maximum by this
FP16_MAX = float(np.finfo(np.float16).max)  # 65 504


def _lazy_bound(ex, answer):
    top = 2.0 ** LAZY_UNITS
    overflow = math.log2(FP16_MAX)
    truth = (int(top), 16)
    why = (f"The lazy pass keeps a tile only if no score exceeds m by more than {LAZY_UNITS} "
           f"(log2 units), so every exponential 2^(s - m) it wrote is at most 2^{LAZY_UNITS} = "
           f"{int(top)}. fp16's largest finite value is 65 504, 2^{overflow:.4f}: an "
           f"exponential 16 units above m, 2^16 = 65 536, no longer fits, so {LAZY_UNITS} leaves "
           f"a factor of 2^{16 - LAZY_UNITS} to spare (bf16 reaches 2^128).")
    try:
        got = tuple(_number(v) for v in answer)
        if len(got) != 2:
            raise TypeError
    except (TypeError, _Unreadable):
        return _result(ex, False, "Set `answer` to two numbers: (the largest P the lazy pass "
                                  "writes, the log2 units above m where an fp16 P overflows).")
    if close(got[0], top, abs_=0.5) and close(got[1], overflow, abs_=0.01):
        return _result(ex, True, f"Right: {truth}. " + why)
    hint = ""
    if close(got[0], LAZY_UNITS, abs_=0.01):
        hint = f" {LAZY_UNITS} is the exponent; P holds 2 to that power."
    elif close(got[1], 15, abs_=0.01):
        hint = " 2^15 = 32 768 still fits in fp16; 2^16 does not."
    return _result(ex, False, f"Wrong: you said {got}; it is {truth}. " + why + hint)


# ---------------------------------------------------------------- the registry

_LABS = (
    Lab(Exercise("01.bank_wavefronts", "01_naive", "lab",
                 f"Bank wavefronts: how many wavefronts does stage 01's warp take to read "
                 f"Qi[t*d + x] at d = {WAVE_D}?", POINTS),
        "In stage 01's score loop, `sum += Qi[(tx * d) + x] * Kj[(y * d) + x]`, lane t of the "
        "warp reads the float `Qi[t*d + x]`: word t·d + x of shared memory, counted in 4-byte "
        "words. Shared memory has 32 banks, 4 bytes wide: word w is in bank w mod 32, and a bank "
        "delivers one word a clock; lanes that read the same word share it (a broadcast). A "
        "request takes one pass, a wavefront, per different word in its busiest bank. At d = "
        f"{WAVE_D} and x = 0, how many wavefronts does one such read of the warp take? Count it "
        "by hand, then check it with `banks.wavefronts(words)` (`from flashlab import banks`; "
        "words in 4-byte units; it returns the count and each lane's pass). Set `answer` to a "
        "whole number.",
        _bank_wavefronts),
    Lab(Exercise("02.sectors", "02_coalesced", "lab",
                 "Sectors per request: how many 32-byte sectors does one load of stage 01's warp "
                 "touch?", POINTS),
        "Stage 01 copies a K tile with `Kj[(tx * d) + x] = K[qkv_offset + key * d + x]`: lane t "
        f"of the warp reads the float (4 bytes) at row t, column x of a row-major tile of D = "
        f"{SECTORS_D} floats a row. Global memory moves in 32-byte sectors. How many sectors does "
        "one such load instruction of the warp (x = 0) touch? Set `answer` to a whole number.",
        _sectors),
    Lab(Exercise("03.occupancy", "03_coarsened", "lab",
                 "Occupancy: how many of stage 03's blocks fit on an SM at 64 registers a thread?",
                 POINTS),
        f"Stage 03's block has {OCC_THREADS} threads and, at D = 64, {_n(tiling.smem_bytes())} "
        "bytes of shared memory (`tiling.smem_bytes()`). Suppose a better compiler got the kernel down "
        f"to {OCC_REGISTERS} registers a thread. An H100 SM (sm_90) has 65 536 registers "
        "(allocated per warp, in units of 256), room for 2 048 threads and 32 blocks, and 228 KiB "
        "= 233 472 bytes of shared memory, of which each block also reserves 1 KiB. How many "
        "blocks can one SM hold? Set `answer` to a whole number.",
        _occupancy),
    Lab(Exercise("05.fragment_owner", "05_mma", "lab",
                 f"Fragment ownership: which lanes hold row {OWNER_ROW} of mma's C fragment?",
                 POINTS),
        "After `mma.sync.aligned.m16n8k16`, a 16 × 8 tile of scores S sits in the warp's C "
        "fragment: each lane holds 4 floats, c0..c3. The softmax needs the max of each row of "
        f"S, so it must know which lanes share a row. Which lanes hold elements of row "
        f"{OWNER_ROW}? Predict it from the ISA's rule (groupID = lane >> 2, threadID_in_group = "
        "lane % 4), then check it with the warp emulation (`fragments.to_fragment(S, 'C')`). Set "
        "`answer` to the lane numbers (a list).",
        _owner),
    Lab(Exercise("06.bank_map", "06_swizzle", "lab",
                 f"A bank map: how many wavefronts does ldmatrix.x4 take with rows padded by "
                 f"{BANK_PAD} bytes?", POINTS),
        f"Stage 05 pads every shared-memory row of D = {BANK_D} halves by 16 bytes "
        f"({2 * BANK_D + 16}-byte rows) so that ldmatrix reads without bank conflicts; stage 06 "
        f"swizzles instead. Suppose you padded by {BANK_PAD} bytes ({2 * BANK_D + BANK_PAD}-byte "
        "rows). One `ldmatrix.x4` is served in four phases, one 8 × 8 matrix each: 8 lanes read "
        "a 16-byte chunk from 8 consecutive rows (chunk 0 here). Shared memory has 32 banks of 4 "
        "bytes, and a phase takes one wavefront per distinct address in its busiest bank. Draw "
        "the bank map (`fragments.bank_map(144)` draws the 16-byte padding's), then: how many "
        "wavefronts does one ldmatrix.x4 take (the ideal is 4)? Set `answer` to a whole number.",
        _bank_map),
    Lab(Exercise("07.pipeline_period", "07_cp_async", "lab",
                 "The pipeline timeline: how long is one tile of a two-buffer loop once it is "
                 "full?",
                 POINTS),
        f"In stage 07's loop a K/V tile issued at time t starts arriving {PIPE_LATENCY:g} ns "
        f"later (the round trip to memory), then streams in for {PIPE_LOAD:g} ns (its bytes at "
        f"the block's bandwidth); its math takes {PIPE_COMPUTE:g} ns. With two buffers, tile "
        "j + 1 is issued when tile j's math starts. How many ns a tile does the loop take once it "
        f"is full? (Stage 06, one buffer, takes {PIPE_LATENCY:g} + {PIPE_LOAD:g} + "
        f"{PIPE_COMPUTE:g} = {_n(int(PIPE_LATENCY + PIPE_LOAD + PIPE_COMPUTE))} ns.) Draw it with "
        "`diagrams.pipeline_timeline` if it helps. Set `answer` to a number of ns.",
        _pipeline),
    Lab(Exercise("08.tuning", "08_tuned", "lab",
                 f"A tuning decision: which switches does the tuned kernel turn off at D = "
                 f"{TUNE_D}, non-causal?", POINTS),
        "Stage 08's autotune times the winning shape with each of its switches (FOLD_SCALE, "
        "SKIP_RESCALE, WARP_SKIP, LANE_OFFSETS, ONE_KSTEP) switched off in turn, beside the shape "
        "with all of them on, and keeps a switch only where switching it off lost. Read the "
        "recorded log (`log = fl.tables.tune_log()`; `tuning.scores(log)` has every variant's "
        f"score: 'all switches on, timed again' and 'without <switch>'): at D = {TUNE_D}, "
        "non-causal, which switches does the tuned kernel turn off? (WARP_SKIP has nothing to "
        "skip without a mask: it is not timed there and stays on.) Set `answer` to a list of "
        "switch names, [] for none.",
        _tuning),
    Lab(Exercise("09.descriptor", "09_wgmma", "lab",
                 "A wgmma descriptor by hand: what is V's for one k-step of P·V?", POINTS),
        f"Stage 09 multiplies O += P V with V read from shared memory through a descriptor "
        f"(hp.DESCRIPTOR_FIELDS; `hp.encode_descriptor(addr, lead_bytes, stride_bytes)` packs one). "
        f"A V tile of {DESC_BC} keys at D = 128 sits at shared address 0x{DESC_V0:x} in the 128-byte "
        f"swizzle (two blocks of {DESC_BC} rows x 64 columns, one after the other). Give the "
        f"descriptor of k-step ks = {DESC_KS} (keys {16 * DESC_KS}-{16 * DESC_KS + 15}), as the "
        "kernel builds it. Set `answer` to the 64-bit value (an int).",
        _descriptor),
    Lab(Exercise("10.parity", "10_tma", "lab",
                 "The mbarrier ring: which buffer, and which phase parity?", POINTS),
        f"Stage 10 runs a ring of STAGES = {RING_STAGES} buffers: tile j lives in buffer j % STAGES, "
        "each buffer has a full and an empty mbarrier, each completing one phase per round of the "
        "ring, and loads run STAGES - 2 tiles ahead. At iteration j = "
        f"{RING_TILE}: in which buffer is tile {RING_TILE} and which parity do the warps wait for on "
        "its full barrier; into which buffer does the elected thread load the next tile, and with "
        "which parity does it first wait on that buffer's empty barrier? Set `answer` to "
        "(buffer, full parity, refill buffer, empty parity).",
        _parity),
    Lab(Exercise("11.registers", "11_warpspec", "lab",
                 "setmaxnreg: how many registers does a consumer thread get with three "
                 "consumers?", POINTS),
        "Stage 11's block is a producer warpgroup and CONSUMERS consumer warpgroups of 128 "
        "threads each, launched with `__launch_bounds__(THREADS, 1)` on an SM of "
        f"{_n(hp.REGS_PER_SM)} registers (a thread's count is a multiple of 8, at most 255). Once "
        "running, the producer gives registers back with `setmaxnreg.dec` down to PRODUCER_REGS "
        "and the consumers take the rest with `setmaxnreg.inc` (a multiple of 8). Suppose the "
        f"kernel ran CONSUMERS = {REG_CONSUMERS} with PRODUCER_REGS = {REG_PRODUCER}, what its "
        "producer keeps beside two consumers: how many registers "
        "may a thread hold when the kernel starts, and how many does a consumer thread hold after "
        "setmaxnreg? "
        "(`hp.register_budget` computes both; predict them first.) Set `answer` to (registers at "
        "launch, registers of a consumer after setmaxnreg).",
        _registers),
    Lab(Exercise("12.store_sectors", "12_tma_store", "lab",
                 "The end of a work item: how many sectors does a consumer's O take, both "
                 "ways?", POINTS),
        f"A consumer warpgroup ends a work item with its 64 x {STORE_D} tile of O in registers, "
        "16-bit once packed: thread (warp w, lane = 4 g + t) holds rows 16 w + g and 16 w + g + 8, "
        "columns 8 d + 2 t and 8 d + 2 t + 1 of every 8-column tile d. Stage 11 stores each pair "
        "with one 4-byte st.global, so one warp instruction covers 8 rows of one tile d; O is "
        f"row-major, {2 * STORE_D} bytes a row. How many warp store instructions does the "
        "warpgroup issue; how many 32-byte sectors do they write, counted once per instruction "
        "that touches one; and how many sectors does stage 12's TMA store write for the same "
        "tile? (`hp.o_store_requests` counts them; predict first.) Set `answer` to "
        "(instructions, sectors from registers, sectors by the TMA).",
        _store_sectors),
    Lab(Exercise("13.lazy_bound", "13_lazy_rescale", "lab",
                 "The lazy pass: how large can P get, and where would fp16 overflow?", POINTS),
        "After an item's first key tile, stage 13 takes each exponential against the running "
        "maximum m as it stands, P = 2^(s - m) in log2 units, and keeps the tile only when no "
        f"score s of the warp's rows exceeds m by more than {LAZY_UNITS}; otherwise it takes "
        "the tile again the classic way, with the new maximum. P goes to the tensor cores in "
        "16 bits. What is the largest value the lazy pass can write into P, and how many log2 "
        "units above m may a score lie before its exponential no longer fits in fp16 (largest "
        "finite value 65 504)? Set `answer` to (largest P, units above m).",
        _lazy_bound),
)
_BY_ID = {lab.exercise.id: lab for lab in _LABS}
LABS = tuple(lab.exercise for lab in _LABS)


def _lab(id) -> Lab:
    id = getattr(id, "id", id)
    if id not in _BY_ID:
        raise ValueError(f"no lab {id!r}; the labs are: {', '.join(_BY_ID)}")
    return _BY_ID[id]


def prompt(id) -> str:
    """The lab's question, as the notebook shows it."""
    lab = _lab(id)
    return f"**Lab {lab.exercise.id}** ({lab.exercise.points} points). {lab.prompt}"


def answer_check(id, answer) -> Result:
    """Check `answer` to lab `id` without printing: right or wrong and why. An answer of the wrong
    kind (text where a number is asked, ...) is wrong, and the message says what is wanted."""
    lab = _lab(id)
    ex = lab.exercise
    try:
        return lab.check(ex, answer)
    except _Unreadable as err:
        return _result(ex, False, f"Wrong: {err}.")


def check(id, answer) -> Result:
    """A notebook's check cell: print the verdict and why, and return the Result."""
    result = answer_check(id, answer)
    print(result)
    return result


# ---------------------------------------------------------------- grading from the notebook

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
UNANSWERED = "raise NotImplementedError"


def _check_call(id):
    return re.compile(r"""labs\s*\.\s*check\s*\(\s*["']""" + re.escape(id) + r"""["']""")


def notebook_files(ex, root) -> list:
    """Where lab `ex`'s cell may be: its notebook's percent source and its .ipynb."""
    root = Path(root)
    found = []
    for folder, suffix in ((root / "notebooks" / "src", ".py"), (root / "notebooks", ".ipynb")):
        exact = folder / f"{ex.stage}{suffix}"
        found += [exact] if exact.exists() else sorted(folder.glob(f"{ex.stage[:2]}_*{suffix}"))
    return found


def find_cell(ex, root):
    """(file, cell source) of the cell that calls labs.check(ex.id, ...), from the most recently
    changed of the notebook's files that has one; (None, None) where none does."""
    pattern, found = _check_call(ex.id), []
    for path in notebook_files(ex, root):
        cell = next((c for c in cells.code(path) if pattern.search(c)), None)
        if cell is not None:
            found.append((path.stat().st_mtime, path.suffix == ".ipynb", path, cell))
    if not found:
        return None, None
    _, _, path, cell = max(found, key=lambda f: f[:2])
    return path, cell


def solution_code(ex, cell) -> str:
    """The student's code in a check cell: between the solution markers where they are kept, else
    everything above the labs.check call. IPython magics and shell lines are left out."""
    lines = cell.splitlines()
    marks = [i for i, line in enumerate(lines) if line.strip() in (BEGIN, END)]
    begin = next((i for i, line in enumerate(lines) if line.strip() == BEGIN), None)
    end = next((i for i, line in enumerate(lines) if line.strip() == END), None)
    if begin is not None and end is not None and begin < end:
        body = lines[begin + 1:end]
    else:
        call = next(i for i, line in enumerate(lines) if _check_call(ex.id).search(line))
        body = [line for i, line in enumerate(lines[:call]) if i not in marks]
    return "\n".join(line for line in body if not line.lstrip().startswith(("%", "!")))


def namespace() -> dict:
    """What a lab's solution code may use without importing: numpy as np and the notebooks' usual
    names for flashlab and its lesson modules."""
    import flashlab as fl
    from .. import banks
    return dict(np=np, math=math, fl=fl, diagrams=dg, dg=dg, fragments=fr, fr=fr, tiling=tiling,
                banks=banks, tuning=tuning, tables=tables, __name__="__lab__")


def grade_lab(ex, root) -> Result:
    """Grade lab `ex` from the notebook of the edition in `root`: run the student's code from the
    check cell in a fresh namespace and check the `answer` it sets (its printing is swallowed)."""
    root = Path(root)
    path, cell = find_cell(ex, root)
    if path is None:
        where = " or ".join(str(p.relative_to(root)) for p in notebook_files(ex, root)) or \
            f"notebooks/src/{ex.stage}.py or notebooks/{ex.stage}.ipynb (neither exists)"
        return Result(ex.id, False, 0.0,
                      f"no cell calls labs.check(\"{ex.id}\", answer) in {where}")
    code = solution_code(ex, cell)
    rel = path.relative_to(root)
    ns = namespace()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile(code, f"{rel} (lab {ex.id})", "exec"), ns)
    except NotImplementedError:
        return Result(ex.id, False, 0.0, f"not answered yet in {rel}: the cell still raises "
                      "NotImplementedError (replace it with `answer = ...`)")
    except Exception as err:  # noqa: BLE001 -- the student's code may raise anything
        return Result(ex.id, False, 0.0, f"the code in {rel} raised {type(err).__name__}: {err}")
    if "answer" not in ns:
        return Result(ex.id, False, 0.0, f"the cell in {rel} sets no `answer`")
    return answer_check(ex, ns["answer"])
