"""The CPU labs' answer keys, compiled from the lesson models (the solution edition only: an
edition leaves this file out and ships the compiled keys, flashlab/course/lab_keys.json).

Each lab's key has four parts:

  * the accepted answers, in their canonical form (flashlab.course.labdefs: the lab's form reads
    an answer into it); a number with a tolerance becomes every canonical value in its window;
  * the message for a right answer: the full explanation, which may state the answer;
  * the message for a wrong answer: what to reconsider, where to look, which helper to call;
    never the answer, nor a number it follows from by plain arithmetic. `{said}` is replaced by
    the student's answer, `{hint}` by the hint below (or nothing);
  * hints for anticipated mistakes, {canonical wrong answer: hint}, under the same rule.

compile_keys(salt) turns them into the JSON flashlab.course.labs.keys() reads
("flashlab-labkeys/1"):

    {"format": "flashlab-labkeys/1", "salt": "...",
     "labs": {"02.sectors": {"right": {sha256: sealed message, ...},
                             "mistakes": {sha256: sealed hint, ...},
                             "wrong": "Wrong: you said {said}.{hint} ..."},
              "08.tuning": {"skipped": "no tuning log recorded ..."}, ...}}

where sha256 is labdefs.answer_hash(salt, lab, canonical answer) and a sealed message is XORed
with a SHA-256 counter-mode keystream derived from the canonical answer that unlocks it
(labdefs.unseal), in base64. A wrong answer's message is plain: it holds no answer. This module
imports labdefs, never labs (which imports this one when it compiles the keys).

    python -m flashlab.course.labkeys OUT.json [--salt SALT]   # write the keys for an edition
"""
import argparse
import base64
import json
import math
import re
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import diagrams as dg
from .. import fragments as fr
from .. import lazy_rescale, ring, tma_store, warpspec, wgmma
from .. import tables, tiling, tuning
from ..autotune import SWITCHES
from ..banks import BANK_BYTES, BANKS, wavefronts
from ..tables import NotRecorded
from . import labdefs
from .labdefs import _join, _n


@dataclass
class Key:
    right: dict                                  # {canonical answer: message}
    wrong: str                                   # with {said} and {hint}
    mistakes: dict = field(default_factory=dict)  # {canonical wrong answer: hint}


@dataclass
class Skip:
    why: str


def _canon(id, value) -> str:
    return labdefs.form(id).canonical(value)


def _wrong(text) -> str:
    return "Wrong: you said {said}.{hint} " + text


def close(x, truth, rel=0.02, abs_=1.0) -> bool:
    """A float answer's tolerance: within `rel` of the truth, or `abs_` units of it."""
    return abs(x - truth) <= max(rel * abs(truth), abs_)


def _window(id, truth, digits=0, **tol) -> set:
    """Every canonical value of lab `id`'s number form, on its grid of `digits` decimals, that is
    close() to `truth`."""
    step = 10.0 ** -digits
    width = max(tol.get("rel", 0.02) * abs(truth), tol.get("abs_", 1.0))
    lo, hi = math.floor((truth - width) / step), math.ceil((truth + width) / step)
    return {_canon(id, k * step) for k in range(lo, hi + 1) if close(k * step, truth, **tol)}


# ---------------------------------------------------------------- 01: bank wavefronts

WAVE_D = 80


def _bank_wavefronts(id):
    words = np.arange(32) * WAVE_D
    cost = wavefronts(words)[0]
    hit = sorted(set((words % BANKS).tolist()))
    at64 = wavefronts(np.arange(32) * 64)[0]
    padded = wavefronts(np.arange(32) * (WAVE_D + 1))[0]
    kj = wavefronts(np.zeros(32, dtype=int))[0]
    share = 32 // len(hit)
    right = (f"Right: {cost} wavefronts. Lane t reads word {WAVE_D}·t + x, in bank "
             f"({WAVE_D}·t + x) mod {BANKS} = ({WAVE_D % BANKS}·t + x) mod {BANKS}: at x = 0 the "
             f"lanes fall in banks {_join(hit)}, {share} lanes in each at {share} different "
             f"words, and a bank delivers one word a clock: {cost} wavefronts, a {cost}-way "
             f"conflict. At d = 64 all 32 lanes share bank 0: {at64}. The same warp's read of "
             f"Kj[y*d + x] is one word for all lanes, a broadcast: {kj}. Rows of d + 1 = "
             f"{WAVE_D + 1} floats put the 32 lanes in 32 different banks: {padded} wavefront; "
             "padding the rows is how stage 03 removes its conflicts.")
    wrong = _wrong(f"Work out each lane's bank at x = 0, word t·d mod {BANKS} with d = {WAVE_D}, "
                   "and count the different words the busiest bank must deliver: one wavefront "
                   "each. Check it with `banks.wavefronts(words)` (words in 4-byte units).")
    mistakes = {
        at64: f"{at64} is the count at d = 64, where every lane lands in bank 0.",
        kj: f"{kj} wavefront needs the 32 words in 32 different banks, or one word for every lane "
            "(a broadcast, as Kj[y*d + x] is); here the lanes read 32 different words.",
        WAVE_D: f"{WAVE_D} is d, the lanes' stride in words; a wavefront count is how many "
                "different words the busiest bank must deliver.",
        32 * BANK_BYTES // dg.SECTOR: "4 would be a global-memory count (128 consecutive bytes in "
                                      "32-byte sectors); shared memory is served by banks, one "
                                      "word per bank per clock.",
        32 * BANK_BYTES: "That counts bytes; the question counts wavefronts (passes through the "
                         "banks).",
        32 * WAVE_D: f"{32 * WAVE_D} is how often the warp executes this read in one visit "
                     f"(32 keys × {WAVE_D} dims); the question asks about one read.",
        len(hit): "A wavefront count is the number of passes the busiest bank needs, one per "
                  "different word it must deliver; it is not a number of banks.",
    }
    return Key({_canon(id, cost): right}, wrong, {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 02: sectors per request

SECTORS_OFFSET = 16   # bytes past a sector boundary where the warp's first float sits


def _sectors(id):
    addr = SECTORS_OFFSET + 4 * np.arange(32)
    req = dg.sectors_per_request(addr)
    aligned = dg.sectors_per_request(4 * np.arange(32)).sectors
    stage01 = dg.sectors_per_request(dg.warp_addresses("01_naive", D=64, step=0)).sectors
    first, last = int(addr[0]), int(addr[-1]) + 3
    right = (f"Right: {req.sectors} sectors. Lane t reads bytes {first} + 4t to {first + 3} + 4t "
             f"from the sector boundary, so the warp's 128 bytes run from byte {first} to byte "
             f"{last}: sectors {first // dg.SECTOR} to {last // dg.SECTOR}, the first and the last "
             f"half used. {req.sectors} sectors move {req.sectors * dg.SECTOR} bytes for the 128 "
             f"asked ({req.efficiency:.0%} used); aligned, the same load touches {aligned}. "
             "Allocators (cudaMalloc, PyTorch's) hand out blocks aligned to 256 bytes or more, so "
             "a misaligned tensor is a view that starts inside one, a slice like this. A kernel "
             "that loads 16 bytes a lane cannot take it at all: a vector load must be aligned to "
             "its size.")
    wrong = _wrong("Write down the bytes each lane reads, counted from a sector boundary (the "
                   f"first float sits {SECTORS_OFFSET} bytes past one, and lane t reads the 4 "
                   "bytes 4t further on), then count the distinct 32-byte sectors (byte // 32) "
                   "that any lane's bytes fall in. `diagrams.sectors_per_request(addresses)` "
                   "counts them.")
    mistakes = {
        aligned: f"{aligned} is the count when the warp's 128 bytes start on a sector boundary; "
                 f"these start {SECTORS_OFFSET} bytes into one.",
        stage01: f"{stage01} is stage 01's count, where each lane reads its own row; stage 02's "
                 "lanes read consecutive floats.",
        128: "That counts bytes; the question counts 32-byte sectors.",
        1: "A sector holds 32 bytes; the warp reads 128.",
    }
    return Key({_canon(id, req.sectors): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 03: occupancy

OCC_D, OCC_BR, OCC_BC, OCC_REGISTERS, OCC_CC = 128, 64, 64, 64, "9.0"
RECORDED_REGISTERS = 120   # what ptxas gives stage 03 at D = 64 for sm_90 (notebook 03, section 6)


def _occupancy(id):
    threads = tiling.THREADS
    smem = tiling.smem_bytes(OCC_D, OCC_BR, OCC_BC)
    occ = tiling.occupancy(OCC_REGISTERS, smem, threads, OCC_CC)
    lim, blocks = occ["limits"], occ["blocks"]
    regs_sm, threads_sm, blocks_sm, smem_sm = tiling.SM_LIMITS[OCC_CC]
    per_block = math.ceil(OCC_REGISTERS * 32 / 256) * 256 * (threads // 32)
    decides = [name for name, v in lim.items() if v == blocks]
    ld, lp = OCC_D + 4, OCC_BC + 4
    launched = tiling.smem_bytes(OCC_D, OCC_BR, 32)
    launched_blocks = tiling.occupancy(OCC_REGISTERS, launched, threads, OCC_CC)["limits"]
    right = (f"Right: {blocks} block{'s' if blocks != 1 else ''} ({occ['warps']} warps, "
             f"{occ['occupancy']:.1%} occupancy). Each limit counts: registers allow "
             f"{lim['registers']} ({OCC_REGISTERS} × {threads} = {_n(per_block)} a block, "
             f"{_n(regs_sm)} // {_n(per_block)}), threads {lim['threads']} ({_n(threads_sm)} // "
             f"{threads}), the block limit {lim['blocks']}, and shared memory "
             f"{lim['shared memory']}: 4 × ({OCC_BR}·{ld} + {OCC_BC}·{ld} + {OCC_BC}·{OCC_D} + "
             f"{OCC_BR}·{lp}) = {_n(smem)} bytes, + 1 024 reserved = {_n(smem + 1024)} a block, "
             f"and {_n(smem_sm)} // {_n(smem + 1024)} = {lim['shared memory']} (two blocks would "
             f"need {_n(2 * (smem + 1024))}). The smallest, {_join(decides)}, decides. That is "
             f"why the launch takes 32-key tiles at D = 128: {_n(launched)} bytes a block, room "
             f"for {launched_blocks['shared memory']}.")
    wrong = _wrong("Work out what each limit allows on its own: registers (a warp's registers "
                   "rounded up to a multiple of 256, times the block's warps), threads, the "
                   "32-block limit, and shared memory (the block's bytes at D = 128 with 64 × 64 "
                   "tiles, plus the 1 KiB each block reserves); a block must fit all four at "
                   "once. `tiling.occupancy(registers, smem_bytes)` gives each limit.")
    mistakes = {}
    for name, v in lim.items():
        if v != blocks:
            mistakes.setdefault(v, f"{v} is what the {name} limit alone allows; a block must fit "
                                   "every limit at once.")
    for v in sorted({launched_blocks["shared memory"],
                     tiling.occupancy(OCC_REGISTERS, tiling.smem_bytes())["limits"]
                     ["shared memory"]} - {blocks}):
        mistakes.setdefault(v, f"{v} is what shared memory allows the tiles the kernel launches "
                               "(32 keys at D = 128, 64 × 64 at D = 64); 64 × 64 tiles at "
                               "D = 128 take more.")
    recorded = tiling.occupancy(RECORDED_REGISTERS, tiling.smem_bytes(), threads, OCC_CC)
    mistakes.setdefault(recorded["blocks"], f"{recorded['blocks']} is what about "
                        f"{RECORDED_REGISTERS} registers a thread allow, the kernel's today; here "
                        f"it uses {OCC_REGISTERS}.")
    mistakes.pop(blocks, None)
    return Key({_canon(id, blocks): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 05: fragment ownership

OWNER_KEY = 37


def _owner(id):
    shape = fr.FRAGMENTS["C"][1]                          # (16, 8)
    tile, col = divmod(OWNER_KEY, shape[1])
    S = np.arange(shape[0] * shape[1]).reshape(shape)     # S[r, c] = 8 r + c: a value says where
    frag = fr.to_fragment(S, "C")                          # the warp emulation: (32 lanes, c0..c3)
    cols = frag % shape[1]
    truth = sorted(np.flatnonzero((cols == col).any(axis=1)).tolist())
    elems = [f"c{i}" for i in range(frag.shape[1]) if cols[truth[0], i] == col]
    t = truth[0] % 4
    right = (f"Right: lanes {_join(truth)}. Key {OWNER_KEY} is column {col} of tile {tile} "
             f"(keys {shape[1] * tile}-{shape[1] * tile + shape[1] - 1}). C's rule gives lane l "
             "columns 2t and 2t + 1 of every 8-key tile, t = l % 4 (threadID_in_group): column "
             f"{col} is t = {t}'s {'first' if col % 2 == 0 else 'second'}, {elems[0]} in row g and "
             f"{elems[1]} in row g + 8, for every groupID g: lanes 4g + {t}, one in each quad, "
             f"each holding the key's scores of 2 of the {shape[0]} rows. So the causal mask "
             "needs no shuffles: lane l holds keys 8n + 2t and 8n + 2t + 1 of tile n, and "
             "compares them with its two rows' positions.")
    wrong = _wrong("Find the key's tile (8 keys a tile) and its column c in that tile; then use "
                   "C's rule: lane l holds columns 2t and 2t + 1 (threadID_in_group t = l % 4) "
                   "of rows g and g + 8 (groupID g = l >> 2), in every tile. Check it with the "
                   "warp emulation: `fragments.to_fragment(tile, 'C')` of a 16 × 8 tile whose "
                   "values say where they came from (8r + c) shows each lane's four elements.")
    quad = [4 * col + i for i in range(4)]
    by_t = [4 * g + col % 4 for g in range(8)]
    mistakes = {
        ",".join(map(str, quad)): f"Lanes {_join(quad)} are the quad of groupID {col}: a quad "
                                  "holds rows of C (rows g and g + 8), not a column. Which part "
                                  "of a lane's number picks its columns?",
        str(col): "One lane holds two columns of a tile, for two rows; a key's scores (16 rows) "
                  "are spread over several lanes.",
        str(OWNER_KEY % 32): "A key is not a lane: find which lanes C's rule gives the key's "
                             "column.",
        ",".join(map(str, by_t)): "threadID_in_group t picks columns 2t and 2t + 1, not column t.",
    }
    mistakes = {_canon(id, k.split(",")): v for k, v in mistakes.items()}
    mistakes.pop(_canon(id, truth), None)
    return Key({_canon(id, truth): right}, wrong, mistakes)


# ---------------------------------------------------------------- 06: a bank map

BANK_D, BANK_PAD = 64, 32


def _bank_map(id):
    row_bytes = 2 * BANK_D + BANK_PAD
    cost = fr.ldmatrix_wavefronts(row_bytes)
    first = [int(fr.smem_offset(r, 0, row_bytes)) // BANK_BYTES % BANKS for r in range(8)]
    groups = {}
    for r, b in enumerate(first):
        groups.setdefault(b, []).append(r)
    shared = [rows for rows in groups.values() if len(rows) > 1]
    why = (f"Row r starts at byte {row_bytes}·r, bank {row_bytes // BANK_BYTES}·r mod {BANKS} = "
           f"{row_bytes // BANK_BYTES % BANKS}·r mod {BANKS}: the first chunks of rows 0-7 start "
           f"in banks {', '.join(map(str, first))}. ")
    if shared:
        b = first[shared[0][0]]
        why += (f"Rows {' and '.join(map(str, shared[0]))} both start in bank {b} (banks "
                f"{b}-{b + 3}), and so on for the other rows, so each 8-row phase is "
                f"{cost.ways}-way: {cost.ways} wavefronts a phase, {cost.wavefronts} for the x4 "
                f"(ideal {cost.ideal}).")
    else:
        why += f"All 8 rows land in different bank groups: {cost.wavefronts} wavefronts."
    right = (f"Right: {cost.wavefronts} wavefronts, {cost.ways}-way. " + why + " Padding by 16 "
             "bytes moves a row by 4 banks, so 8 rows cover all 32: "
             f"{fr.ldmatrix_wavefronts(2 * BANK_D + 16).wavefronts} wavefronts; the XOR swizzle "
             f"gets {fr.ldmatrix_wavefronts(2 * BANK_D, swizzle=True).wavefronts} with no padding "
             "at all.")
    wrong = _wrong(f"Row r starts at byte {row_bytes}·r: find the bank where chunk 0 of each of "
                   "rows 0-7 starts (byte / 4 mod 32), see how many of the 8 rows share a 4-bank "
                   "group (the phase's ways), and count that for each of the x4's 4 phases. "
                   f"`fragments.bank_map({row_bytes})` draws it; "
                   "`fragments.ldmatrix_wavefronts(row_bytes)` counts it.")
    mistakes = {
        cost.ideal: f"{cost.ideal} is the ideal, one wavefront a phase: it needs the 8 rows of a "
                    "phase in 8 different 4-bank groups. Check where rows 0-7 start.",
        fr.ldmatrix_wavefronts(2 * BANK_D).wavefronts:
            f"{fr.ldmatrix_wavefronts(2 * BANK_D).wavefronts} is the dense {2 * BANK_D}-byte "
            "layout, where every row starts in bank 0 (8-way); the padding does spread the rows.",
        1: "An x4 reads four matrices, one phase each: it takes at least 4 wavefronts.",
    }
    mistakes.pop(cost.wavefronts, None)
    return Key({_canon(id, cost.wavefronts): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 07: the pipeline timeline

PIPE_LOAD, PIPE_COMPUTE, PIPE_LATENCY, PIPE_STAGES = 200.0, 300.0, 500.0, 2


def _pipeline(id):
    L, C, lat, k = PIPE_LOAD, PIPE_COMPUTE, PIPE_LATENCY, PIPE_STAGES
    period = dg.pipeline_period(L, C, k, lat)
    sched = dg.pipeline_schedule(L, C, tiles=8, stages=k, latency=lat)
    starts = sched["compute_start"].to_numpy()
    assert close(starts[-1] - starts[-2], period, 1e-9, 1e-9), "schedule and period disagree"
    serial = dg.pipeline_period(L, C, 1, lat)
    need = dg.pipeline_stages_needed(L, C, lat)
    three = dg.pipeline_period(L, C, 3, lat)
    right = (f"Right: {period:g} ns a tile. The tile issued one ahead (when tile j's math starts) "
             f"needs latency + load = {lat:g} + {L:g} = {lat + L:g} ns to arrive, longer than the "
             f"{C:g} ns of math and the {L:g} ns of the link, so the loop waits for it: the period "
             f"is max({C:g}, {L:g}, ({lat:g} + {L:g}) / ({k} - 1)) = {period:g} ns. "
             f"pipeline_schedule({L:g}, {C:g}, stages={k}, latency={lat:g}) starts the math of "
             f"tiles 0-3 at {', '.join(f'{s:g}' for s in starts[:4])} ns: {period:g} ns apart. "
             f"That is Little's law: {lat + L:g} ns of latency and transfer must be covered by "
             f"tiles in flight; three buffers give {three:g} ns, and {need} make it compute-bound "
             f"({C:g} ns; pipeline_stages_needed).")
    wrong = _wrong("Once the loop is full a tile takes the slowest of three limits: the math, the "
                   "link (a tile's bytes streaming in), and the latency: the tile issued one "
                   "ahead must have arrived before its math can start (section 4's condition, "
                   "(S − 1) · period ≥ latency + load). `diagrams.pipeline_period(load, compute, "
                   "stages, latency)` computes it; `diagrams.pipeline_timeline` draws it.")
    mistakes = {}
    for value, hint in ((C, f"{C:g} ns, the math alone, would hold if the tile issued one ahead "
                            "arrived within a tile's math. Does it?"),
                        (serial, f"{_n(int(serial))} ns is stage 06's period: one buffer, "
                                 "nothing overlapped."),
                        (L, f"{L:g} ns is the link alone; what else must a tile wait for?"),
                        (max(L + C, lat), "Neither the latency alone nor load + compute is the "
                                          "period of an overlapped loop: work out the three "
                                          "limits.")):
        for c in _window(id, value):
            mistakes.setdefault(c, hint)
    right_set = _window(id, period)
    mistakes = {c: h for c, h in mistakes.items() if c not in right_set}
    return Key({c: right for c in sorted(right_set, key=float)}, wrong, mistakes)


# ---------------------------------------------------------------- 08: a tuning decision

TUNE_D, TUNE_CAUSAL, TUNE_MARGIN = 64, True, 3.0   # keep a switch only if off cost > 3 %


def _log():
    """The tuning log of the GPU shown, else the one with the most rows recorded, else None."""
    try:
        return tables.tune_log()
    except NotRecorded:
        df = tables.TUNE08.load()
        if df.empty:
            return None
        return tables.tune_log(df["gpu"].value_counts().index[0])


def _tuning(id):
    log = _log()
    if log is None:
        return Skip("no tuning log recorded (data/tune08.csv): run `flashlab tune` on a GPU first")
    gpu = log["gpu"].iloc[0]
    v = tuning.verdicts(log).xs((TUNE_D, TUNE_CAUSAL), level=["D", "causal"])
    timed = {name: float(v.loc[name, "off_vs_on_pct"]) for name in SWITCHES
             if v.loc[name, "without"] == v.loc[name, "without"]}
    off = sorted(name for name, pct in timed.items() if pct >= -TUNE_MARGIN)
    chosen = tuning.choice(log)[(TUNE_D, TUNE_CAUSAL)]
    off_any = sorted(name for name, bit in SWITCHES.items() if not chosen[-1] & bit)
    mask = "causal" if TUNE_CAUSAL else "non-causal"

    def line(name):
        r = v.loc[name]
        if name not in timed:
            return f"{name}: not timed off, so it stays on"
        verdict = (f"off cost more than {TUNE_MARGIN:g} %: kept" if name not in off else
                   f"off within {TUNE_MARGIN:g} % or faster: dropped")
        return (f"{name}: {r['all_on']:.1f} TFLOP/s all on, {r['without']:.1f} without "
                f"({r['off_vs_on_pct']:+.1f} %): {verdict}")

    said = _join(off) if off else "none"
    right = (f"Right: under the {TUNE_MARGIN:g} % rule it turns off {said} (D = {TUNE_D}, {mask}, "
             f"log recorded on {gpu}). " + "; ".join(line(n) for n in SWITCHES) + ". The "
             "autotune's own rule, which keeps a switch wherever switching it off lost at all, "
             f"turns off {_join(off_any) if off_any else 'none'}: the margin also drops the "
             "switches whose value is within the noise of two timings.")
    wrong = _wrong(f"For each switch, read its row at D = {TUNE_D}, {mask}, in "
                   "`tuning.verdicts(log)`: 'off_vs_on_pct' is the change in score with the "
                   "switch off (negative: it ran slower without it). Under the rule a switch "
                   f"stays on only where that change is below −{TUNE_MARGIN:g} %; a switch not "
                   "timed stays on.")
    mistakes = {}
    if off_any != off:
        mistakes[_canon(id, off_any)] = (
            "That is what the autotune's own rule turns off (it keeps a switch wherever "
            f"switching it off lost at all); this rule keeps a switch only where it lost more "
            f"than {TUNE_MARGIN:g} %.")
    flipped = sorted(name for name, pct in timed.items() if pct <= TUNE_MARGIN)
    if flipped != off:
        mistakes.setdefault(_canon(id, flipped), (
            "A negative 'off_vs_on_pct' means the kernel ran slower with the switch off: that "
            "is a switch worth keeping."))
    return Key({_canon(id, off): right}, wrong, mistakes)


# ---------------------------------------------------------------- 09: a wgmma descriptor

DESC_V0, DESC_BC, DESC_KS = 0x14000, 128, 3   # a V tile's shared address, its keys, the k-step


def _descriptor(id):
    start = DESC_V0 + DESC_KS * 16 * 128
    lead, stride = DESC_BC * 128, 1024
    truth = wgmma.encode_descriptor(start, lead, stride)
    right = (f"Right: 0x{truth:016x}. k-step {DESC_KS} of P·V reads keys {16 * DESC_KS}-"
             f"{16 * DESC_KS + 15}: 16 rows of 128 bytes each per k-step, so the start is "
             f"0x{DESC_V0:x} + {DESC_KS} x 2048 = 0x{start:x}; V is read transposed (N-major), "
             "so the leading byte offset is the distance between its 64-column blocks, "
             f"{DESC_BC} rows x 128 = {lead} bytes, and the stride byte offset is 8 rows, 1024 "
             "bytes; swizzle mode 1 (128-byte). Each field is its bytes >> 4: "
             f"{wgmma.decode_descriptor(truth)}.")
    wrong = _wrong("Decode yours with `wgmma.decode_descriptor(answer)` and check each field: the "
                   "start address of k-step ks (16 keys of 128 bytes a k-step), the leading byte "
                   "offset (V is read N-major: what separates its 64-column blocks?), the stride "
                   "byte offset (8 rows of 128 bytes), and the swizzle mode (128-byte).")
    mistakes = {
        wgmma.encode_descriptor(DESC_V0, lead, stride):
            "Your start address is the tile's; k-step ks starts 16 keys a k-step further in.",
        wgmma.encode_descriptor(start, stride, lead):
            "Your leading and stride offsets are swapped: for an N-major operand the leading "
            "offset jumps between 64-column blocks.",
        wgmma.encode_descriptor(start, 16, stride):
            "A leading offset of 16 is what K-major operands (Q, K) carry; V is read N-major.",
        start: "That is a single address; the descriptor packs four fields into 64 bits.",
        start >> 4: "That is a single address field; the descriptor packs four into 64 bits.",
    }
    for mode in (0, 2, 3):
        mistakes[wgmma.encode_descriptor(start, lead, stride, swizzle=mode)] = (
            "The tile is 128-byte swizzled: check the mode in bits 62-63 (wgmma.SWIZZLE_MODES).")
    mistakes.pop(truth, None)
    return Key({_canon(id, truth): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 10: the ring's parities

RING_STAGES, RING_TILE = 4, 9


def _parity(id):
    S, j = RING_STAGES, RING_TILE
    nxt = j + S - 2
    truth = (j % S, (j // S) & 1, nxt % S, (nxt // S - 1) & 1)
    right = (f"Right: {truth}. Tile {j} is in buffer {j} % {S} = {truth[0]}; it is that buffer's "
             f"round {j // S} (rounds 0, 1, 2, ...), and full[b] completes once a round, so the "
             f"consumers wait for parity ({j} / {S}) & 1 = {truth[1]}. At iteration {j} the "
             f"elected thread loads tile {j} + {S - 2} = {nxt} into buffer {truth[2]}, whose last "
             f"tile, {nxt - S}, must be released first: the empty barrier's completion number "
             f"{nxt // S - 1}, parity {truth[3]}.")
    wrong = _wrong("Tile j lives in buffer j % STAGES, and a barrier completes one phase a round "
                   "of the ring, so its parity counts rounds, not tiles. For the refill: which "
                   "tile does the elected thread load at iteration j (loads run STAGES - 2 ahead), "
                   "which tile held that buffer a round before, and which completion of the empty "
                   "barrier releases it? Section 4's waits, and `tma.ring_schedule(stages=...)` "
                   "(buffer and parity per tile), check it.")
    rounds_as_tiles = (truth[0], j & 1, truth[2], truth[3])
    same_round = (truth[0], truth[1], truth[2], (nxt // S) & 1)
    one_ahead = (truth[0], truth[1], (j + 1) % S, ((j + 1) // S - 1) & 1)
    mistakes = {
        rounds_as_tiles: "The parity counts rounds of the ring (tile / STAGES), not tiles.",
        same_round: "The refill waits for the release of the tile that held the buffer before, "
                    "one round earlier.",
        one_ahead: "Loads run STAGES - 2 tiles ahead, not one.",
    }
    mistakes.pop(truth, None)
    return Key({_canon(id, truth): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 11: registers per role

REG_CONSUMERS, REG_PRODUCER = 4, 40    # four consumer warpgroups; the producer keeps 40


def _registers(id):
    c, prod = REG_CONSUMERS, REG_PRODUCER
    threads = 128 * (1 + c)
    entry = warpspec.entry_registers(threads)
    cons = warpspec.consumer_registers(c, prod)
    truth = (entry, cons)
    pool = entry * (1 + c)
    exact = (pool - prod) / c
    acc128 = sum(warpspec.accumulator_registers(128, 128).values())
    acc64 = sum(warpspec.accumulator_registers(64, 128).values())
    per_sm = warpspec.REGS_PER_SM
    sm = _n(per_sm)
    right = (f"Right: {truth}. A block of {1 + c} warpgroups is {threads} threads; under "
             f"__launch_bounds__({threads}, 1) one block must fit the {sm} registers: {sm} / "
             f"{threads} = {per_sm / threads:g}, rounded down to a multiple of 8: {entry}. "
             "setmaxnreg moves registers only within the block, so each thread position of a "
             f"warpgroup has {1 + c} x {entry} = {pool} registers to share: the producer keeps "
             f"{prod}, the {c} consumers share {pool - prod}: {exact:g} each, down to a multiple "
             f"of 8: {cons} (the kernel's (ENTRY_REGS * (1 + CONSUMERS) - PRODUCER_REGS) / "
             f"CONSUMERS / 8 * 8). That is fewer than a consumer's accumulators take with "
             f"128-key tiles: {acc128} at D = 128 (O 64, S 64, P 32) and {acc64} at D = 64. "
             "Four consumers do not fit; three fit at D = 64 only once the producer drops to 32.")
    wrong = _wrong("Go through section 3's budget for this block: the cap at launch, the pool "
                   "setmaxnreg shares out within the block, the producer's part and the "
                   "consumers' shares, each a multiple of 8. "
                   "`warpspec.register_budget(consumers=..., producer_regs=...)` computes both.")
    mistakes = {
        (entry, int(exact)): "setmaxnreg takes multiples of 8: round the share down.",
        (warpspec.entry_registers(512), warpspec.consumer_registers(3, prod)):
            "That is section 3's block of three consumers; this one has four.",
        (warpspec.entry_registers(384), warpspec.consumer_registers(2, prod)):
            "That is the two-consumer block the kernel runs at D = 128; this one has four.",
        (entry, entry): "That is the cap at launch for every warpgroup; setmaxnreg gives the "
                        "consumers what the producer hands back.",
        (entry, per_sm // threads): "That splits the registers evenly; setmaxnreg moves "
                                    "them from the producer to the consumers.",
    }
    mistakes.pop(truth, None)
    return Key({_canon(id, truth): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 12: sectors of O

STORE_D = 256  # the head dim of lab 12.store_sectors


def _store_sectors(id):
    req = tma_store.o_store_requests(STORE_D)
    s11, s12 = req.iloc[0], req.iloc[1]
    truth = (int(s11.instructions), int(s11.sectors), int(s12.sectors))
    per_thread = STORE_D // 4
    right = (f"Right: {truth}. Each thread holds 2 rows x {STORE_D // 8} tiles of 8 columns, 4 "
             f"bytes of each: {per_thread} stores a thread, so the warpgroup's 4 warps issue 4 x "
             f"{per_thread} = {truth[0]} warp instructions. One of them writes 16 bytes in each of "
             f"8 rows ({2 * STORE_D} bytes apart): 8 sectors, each half used, {_n(truth[1])} in "
             f"all. The TMA writes the 64 x {STORE_D} x 2 = {_n(64 * STORE_D * 2)} bytes as whole "
             f"sectors: {_n(truth[2])}, half as many, in {int(s12.tma_boxes)} boxes of 64 x 64.")
    small = tma_store.o_store_requests(128)
    wrong = _wrong("Count a thread's stores first (2 rows, and a 4-byte pair in every 8-column "
                   "tile of the head dim), then the warp instructions (one per store, per warp), "
                   "the sectors each instruction touches (its 8 rows, 16 bytes each), and the "
                   "bytes of the whole 64-row tile in whole 32-byte sectors for the TMA. "
                   "`tma_store.o_store_requests(D)` counts them.")
    mistakes = {
        (per_thread, truth[1], truth[2]): "That is one thread's count; a warp instruction is "
                                          "issued per warp.",
        (truth[0], truth[2], truth[2]): "That counts sectors as if each were written once, "
                                        "full; each instruction sends its own.",
        (int(small.iloc[0].instructions), int(small.iloc[0].sectors), int(small.iloc[1].sectors)):
            "Those are section 1's counts at D = 128; count them again at this head dim.",
    }
    mistakes.pop(truth, None)
    return Key({_canon(id, truth): right}, wrong,
               {_canon(id, k): v for k, v in mistakes.items()})


# ---------------------------------------------------------------- 13: the lazy bound

LAZY_THRESHOLD = 10      # the variant's threshold (the kernel's is lazy_rescale.LAZY_UNITS)
E4M3_MAX = labdefs.E4M3_MAX             # 448


def _lazy_bound(id):
    top = 2 ** LAZY_THRESHOLD
    units = math.log2(E4M3_MAX)
    truth = _canon(id, (top, units))
    kernel = lazy_rescale.LAZY_UNITS
    right = (f"Right: {truth}. The lazy pass keeps a tile only if no score exceeds m by more than "
             f"{LAZY_THRESHOLD} (log2 units), so every exponential 2^(s - m) it writes is at most "
             f"2^{LAZY_THRESHOLD} = {_n(top)}. e4m3's largest finite value, 448, is "
             f"2^{units:.3f}: a score {units:.1f} units above m already gives a P past it. So "
             f"this variant could overflow its P: an FP8 lazy pass needs a threshold of "
             f"{math.floor(units)} or less. Stage 13's {kernel} (P at most 2^{kernel} = "
             f"{2 ** kernel}) would still fit, with less than a factor of 2 to spare, where fp16's "
             f"65 504 (2^15.9991) leaves it a factor of 2^{16 - kernel}.")
    wrong = _wrong("The largest P is the largest exponential the lazy pass lets through; an "
                   "e4m3 P overflows where 2^(s - m) passes e4m3's largest finite value. Section "
                   "2 works both out for stage 13's threshold and fp16.")
    mistakes = {
        (2 ** kernel, units): f"2^{kernel} is stage 13's bound, at its threshold of {kernel}; "
                              "this variant's threshold is another.",
        (LAZY_THRESHOLD, units): f"{LAZY_THRESHOLD} is the exponent; P holds 2 to that power.",
        (top, 16): "16 units is where fp16 overflows; e4m3's largest value is far smaller.",
        (top, math.ceil(units)): "A score need not lie a whole number of units above m: the "
                                 "limit is where 2^x reaches e4m3's largest value.",
        (top, math.floor(units)): "A score need not lie a whole number of units above m: the "
                                  "limit is where 2^x reaches e4m3's largest value.",
    }
    mistakes = {_canon(id, k): v for k, v in mistakes.items()}
    mistakes.pop(truth, None)
    return Key({truth: right}, wrong, mistakes)


# ---------------------------------------------------------------- 98: the ring

MERGE = ((1.0, 0.0), 0.5, (0.0, 2.0), 0.5 + math.log(3))   # o_A, lse_A, o_B, lse_B
BALANCE_W, HIDE = 8, dict(tflops=500.0, tokens=1048576)


def _mistaken(id, truth, mistakes):
    return {c: v for c, v in ((_canon(id, k), v) for k, v in mistakes.items())
            if c != _canon(id, truth)}


def _merge(id):
    import torch
    (oa, la, ob, lb), wa, wb = MERGE, math.exp(MERGE[1]), math.exp(MERGE[3])
    o, lse = ring.merge(*(torch.tensor([x], dtype=torch.float64) for x in MERGE))
    truth = (*o[0].tolist(), float(lse[0]))
    right = (f"Right: {_canon(id, truth)}. Each part's weight is e^lse, the sum of its exponentials: "
             f"e^{la} and 3 e^{la}, so B carries 3/4 of the row: o = 1/4 o_A + 3/4 o_B and lse = "
             f"ln(e^{la} + 3 e^{la}) = {la} + ln 4. ring.merge computes it against the larger lse "
             "(e^(lse - m)) so that nothing overflows, and a part with no keys (lse = -inf) "
             "weighs 0.")
    wrong = _wrong("Weigh each part's o by its share of the row's exponentials, e^lse_A and "
                   "e^lse_B over their sum; the merged lse is the log of that sum. Section 2 "
                   "writes both; `ring.merge` computes them.")
    return Key({_canon(id, truth): right}, wrong, _mistaken(id, truth, {
        ((oa[0] + ob[0]) / 2, (oa[1] + ob[1]) / 2, truth[2]):
            "That is the plain average; the parts weigh by their exponentials.",
        (*truth[:2], lb): "The merged lse adds both parts' exponentials; it is not the larger.",
        (*truth[:2], la + lb): "lse is a log of a sum: add e^lse, not lse.",
        (wa * oa[0] + wb * ob[0], wa * oa[1] + wb * ob[1], truth[2]):
            "Divide by the sum of the weights: o is an average."}))


def _balance(id):
    work = ring.step_work(BALANCE_W, True, "contiguous")
    per_rank = work.sum(axis=0)
    truth = (per_rank.max() / per_rank.mean(), ring.balance(BALANCE_W, True, "contiguous"))
    right = (f"Right: {_canon(id, truth)}. Rank r has r whole blocks and half of its own: "
             f"{BALANCE_W - 0.5:g} for the last, {per_rank.mean():g} on average. Every step but "
             f"the first has a rank with a whole block, so the ring lasts 0.5 + {BALANCE_W - 1} "
             f"block times while the average rank computes {per_rank.mean():g}: "
             f"{truth[1]:.2f}. It tends to 1/2 as W grows; the zig-zag split gives every rank "
             "half a block at every step, and keeps all of it.")
    wrong = _wrong("Count each rank's blocks (whole, half or none) over the ring, then the "
                   "time: a step lasts as long as its busiest rank's block. Section 4 does it "
                   "for four ranks; `ring.step_work(8, True, 'contiguous')` lists them.")
    four = ring.step_work(4, True, "contiguous").sum(axis=0)
    return Key({_canon(id, truth): right}, wrong, _mistaken(id, truth, {
        (four.max() / four.mean(), ring.balance(4, True, "contiguous")):
            "That is section 4's ring of four ranks; this one has eight.",
        (truth[0], 0.5): "The first step's blocks are halves for every rank.",
        (BALANCE_W, truth[1]): "The busiest rank's own block is only half computed."}))


def _hide(id):
    link = ring.LINKS_GBS["ib_ndr"]
    need = ring.tokens_to_hide(HIDE["tflops"], link, causal=True, training=True)
    truth = (round(need), HIDE["tokens"] // round(need))
    fwd = ring.tokens_to_hide(HIDE["tflops"], link, causal=True)
    full = ring.tokens_to_hide(HIDE["tflops"], link, training=True)
    right = (f"Right: {truth}. The forward's ring needs 2·2·rate / (4·½·link) = {_n(round(fwd))} "
             f"tokens, the backward's, with 12 bytes a token and row (K, V and fp32 dK, dV) "
             f"against 2.5 times the FLOPs, {_n(round(need))}: the larger binds. "
             f"{_n(HIDE['tokens'])} / {_n(round(need))} = {HIDE['tokens'] / need:.1f}: "
             f"{truth[1]} GPUs. Over NVLink the same ring hides its transfers from "
             f"{_n(round(need * link / ring.LINKS_GBS['nvlink4']))} tokens a GPU.")
    wrong = _wrong("Set a step's FLOPs on n tokens (they grow with n²) against its bytes (they "
                   "grow with n) for both rings, the forward's and the backward's, and take the "
                   "larger n; then divide the sequence by it, rounding down. Section 5 does it "
                   "over NVLink; `ring.tokens_to_hide` computes it.")
    n = HIDE["tokens"]
    return Key({_canon(id, truth): right}, wrong, _mistaken(id, truth, {
        (round(fwd), n // round(fwd)): "That is the forward's ring alone; a training step "
                                       "runs the backward's too.",
        (round(full), n // round(full)): "That is without the mask; under it a step's work "
                                         "halves, its bytes do not.",
        (truth[0], -(-n // truth[0])): "Each GPU must hold that many tokens: round down."}))


# ---------------------------------------------------------------- compiling

_BUILDERS = {"01.bank_wavefronts": _bank_wavefronts, "02.sectors": _sectors,
             "03.occupancy": _occupancy, "05.fragment_owner": _owner, "06.bank_map": _bank_map,
             "07.pipeline_period": _pipeline, "08.tuning": _tuning,
             "09.descriptor": _descriptor, "10.parity": _parity, "11.registers": _registers,
             "12.store_sectors": _store_sectors, "13.lazy_bound": _lazy_bound,
             "98.merge": _merge, "98.balance": _balance, "98.hide": _hide}


def key(id):
    """Lab `id`'s key (Key, or Skip where it cannot be compiled here)."""
    id = labdefs._lab_of(id).exercise.id
    return _BUILDERS[id](id)


def renderings(id, canonical, bare=True) -> list:
    """How an answer of lab `id` may be written in a message: its canonical form and the plain
    ways of printing it (decimal, grouped, hex; a list or tuple as Python prints it; with
    bare=True also a number of 10 or more alone, and a tuple's parts of 3 digits or more).
    bare=False keeps what is specific enough to search prose for: a number with its unit."""
    form = labdefs.form(id)
    out = {canonical, form.said(canonical)}
    if isinstance(form, labdefs.Hex64):
        x = int(canonical, 16)
        out |= {f"0x{x:x}", f"{x:#x}", str(x)}
    elif isinstance(form, (labdefs.Whole, labdefs.Number)):
        x = float(canonical)
        unit = form.what.split()[-1]
        if x == int(x):
            out |= {f"{v} {u}" for v in {str(int(x)), _n(int(x))} for u in (unit,
                                                                           unit.rstrip("s"))}
            if bare and abs(x) >= 10:     # a digit alone is everywhere ("1 KiB")
                out |= {str(int(x)), _n(int(x)), f"{int(x):,}"}
            else:
                out -= {canonical, form.said(canonical)}
    elif isinstance(form, labdefs.Lanes):
        xs = canonical.split(",")
        out |= {", ".join(xs), "[" + ", ".join(xs) + "]", str([int(x) for x in xs])}
    elif isinstance(form, labdefs.Tuple):
        parts = canonical.strip("()").split(", ")
        out |= {", ".join(parts), "[" + ", ".join(parts) + "]"}
        if bare:
            out |= {p for p in parts if len(p.replace(".", "")) >= 3}  # 1024, 8.8: not 0, 1, 3
            out |= {_n(int(p)) for p in parts if p.isdigit() and int(p) >= 1000}
    elif isinstance(form, labdefs.Switches):
        names = canonical.split(",") if canonical else []
        out |= {", ".join(names), str(names)} if names else set()
    return sorted(x for x in out if x)


def leaks(id, text, canonicals, bare=True) -> list:
    """The renderings of `canonicals` (lab `id`'s accepted answers) that `text` contains, each as
    a whole token (32 is not found in 320)."""
    found = []
    for c in canonicals:
        for r in renderings(id, c, bare):
            if re.search(r"(?<![\w.])" + re.escape(r) + r"(?![\w]|\.\d)", text):
                found.append(r)
    return found


def seal(text, salt, id, canonical) -> str:
    """labdefs.unseal's inverse: `text` encrypted with the keystream of `canonical`, in base64."""
    data = text.encode()
    stream = labdefs._keystream(salt, id, canonical, len(data))
    return base64.b64encode(labdefs._xor(data, stream)).decode()


def _vet(id, k: Key):
    """A key that would give its answer away is a bug here, not a message for a student."""
    if not k.right:
        raise ValueError(f"{id}: no accepted answer")
    both = set(k.right) & set(k.mistakes)
    if both:
        raise ValueError(f"{id}: {sorted(both)} both accepted and a mistake")
    if "{said}" not in k.wrong:
        raise ValueError(f"{id}: the wrong answer's message does not say what was said")
    for where, text in [("the wrong message", k.wrong)] + [
            (f"the hint for {c}", h) for c, h in k.mistakes.items()]:
        found = leaks(id, text.replace("{said}", "").replace("{hint}", ""), k.right)
        if found:
            raise ValueError(f"{id}: {where} holds the answer ({found}): {text}")


def compile_keys(salt=None) -> dict:
    """Every lab's key, as JSON-serialisable data (format "flashlab-labkeys/1"; the module's
    docstring has its shape). The same salt gives the same keys; None draws a fresh one."""
    salt = secrets.token_hex(16) if salt is None else str(salt)
    out = {}
    for ex in labdefs.LABS:
        k = key(ex.id)
        if isinstance(k, Skip):
            out[ex.id] = {"skipped": k.why}
            continue
        _vet(ex.id, k)
        out[ex.id] = {
            "right": {labdefs.answer_hash(salt, ex.id, c): seal(m, salt, ex.id, c)
                      for c, m in sorted(k.right.items())},
            "mistakes": {labdefs.answer_hash(salt, ex.id, c): seal(m, salt, ex.id, c)
                         for c, m in sorted(k.mistakes.items())},
            "wrong": k.wrong}
    return {"format": labdefs.KEYS_FORMAT, "salt": salt, "labs": out}


def write_keys(path, salt=None) -> Path:
    """compile_keys() written to `path` as JSON (an edition's flashlab/course/lab_keys.json)."""
    path = Path(path)
    path.write_text(json.dumps(compile_keys(salt), indent=1, sort_keys=True) + "\n",
                    encoding="utf-8")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description="Write the CPU labs' compiled answer keys.")
    ap.add_argument("out", help="the JSON file to write (an edition's flashlab/course/"
                                "lab_keys.json)")
    ap.add_argument("--salt", help="the salt (default: a fresh random one)")
    args = ap.parse_args(argv)
    print(f"wrote {write_keys(args.out, args.salt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
