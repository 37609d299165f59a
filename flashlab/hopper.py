"""Stages 09-13 on the CPU: wgmma's register layouts, its shared-memory matrix descriptor,
the 128-byte swizzle, TMA boxes, the mbarrier ring, warp specialization's register budgets,
work claiming and producer/consumer schedule, the end of a work item (O from registers or
through the TMA), and the lazy rescale's softmax, computed from the PTX ISA's rules and the
kernels' own indexing (no GPU needed).

kernels/09_wgmma.cu multiplies with `wgmma.mma_async.sync.aligned.m64nNk16`, issued together by a
warpgroup (4 consecutive warps, 128 threads); its shared-memory operands are named by 64-bit
matrix descriptors (`wgmma_desc` in kernels/hopper.cuh) over tiles in the 128-byte swizzle
(`sw128`). kernels/10_tma.cu fills those tiles with the tensor memory accelerator
(`cp.async.bulk.tensor`), one elected thread issuing, and counts completion on a ring of
mbarriers. kernels/11_warpspec.cu gives the copies to a warpgroup of their own (the producer),
moves registers to the computing warpgroups (the consumers) with `setmaxnreg`, and runs a
persistent grid that claims work items from a counter; kernels/12_tma_store.cu writes O into
shared memory and copies it out with a TMA store; kernels/13_lazy_rescale.cu takes a tile's
exponentials against the running maximum as it stands. Each function below models a line of
those files; tests/test_hopper.py keeps the lines each one follows and checks that they are still
there (and compiles hopper.cuh's own encoders on the host to compare them with the ones here).

Notation (the PTX ISA's): thread t of a warpgroup is in warp w = t // 32, lane l = t % 32;
groupID g = l // 4 and threadID_in_group q = l % 4, as in flashlab.fragments. Figures are
matplotlib Figures made without pyplot: a notebook cell that ends with one shows it once.
"""
import heapq
import math
from typing import NamedTuple

import matplotlib
import matplotlib.lines
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .banks import BANK_BYTES, BANKS, wavefronts
from .diagrams import SECTOR, sectors_per_request
from .fragments import LANES
from .tiling import SM_LIMITS

WARPGROUP = 128   # threads that issue one wgmma together
WARP = 32
M = 64            # rows of a wgmma: 16 per warp
ATOM_ROWS = 8     # rows of one 128-byte swizzle atom (1024 bytes)
ROW_BYTES = 128   # bytes of one swizzled row: 64 16-bit elements
CHUNK = 16        # bytes of one swizzled chunk: 8 16-bit elements

WARP_COLORS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb")   # pale: warps 0..3 of a warpgroup
PICKED = ("#08306b", "#a50f15", "#00441b", "#3f007d")        # dark: the threads called out
TITLE, LABEL, TEXT = 15, 12, 11                              # font sizes: slides


def _dark(rgba):
    """True for a colour that black text is hard to read on."""
    r, g, b = rgba[:3]
    return 0.299 * r + 0.587 * g + 0.114 * b < 0.45


def _check_n(N):
    if N % 8 or not 8 <= N <= 256:
        raise ValueError(f"wgmma's N is a multiple of 8 from 8 to 256, not {N}")


# ---------------------------------------------------------------- wgmma: who holds what

def accumulator_owner(N=64) -> pd.DataFrame:
    """Where every element of the 64 x N fp32 accumulator of wgmma.m64nNk16 lives: one row per
    element, with the thread (0..127) of the warpgroup, its warp and lane, and the register index
    i of `float d[N/2]` that holds it. The PTX ISA's rule, which hopper.cuh states as "thread t of
    warp w holds rows 16w + t/4 and 16w + t/4 + 8" (t the lane there): d[i] is in 8-column tile
    j = i // 4, r = i % 4, at row 16 w + g + 8 (r // 2), column 8 j + 2 q + r % 2 -- the mma.sync
    m16n8 C layout (flashlab.fragments' "C") on each warp's 16 rows, once per 8 columns."""
    _check_n(N)
    t, i = np.meshgrid(np.arange(WARPGROUP), np.arange(N // 2), indexing="ij")
    w, lane = t // WARP, t % WARP
    g, q = lane // 4, lane % 4
    j, r = i // 4, i % 4
    df = pd.DataFrame(dict(row=(16 * w + g + 8 * (r // 2)).ravel(),
                           col=(8 * j + 2 * q + r % 2).ravel(), thread=t.ravel(), warp=w.ravel(),
                           lane=lane.ravel(), reg=i.ravel()))
    return df.sort_values(["row", "col"], ignore_index=True)


def a_fragment_owner() -> pd.DataFrame:
    """Where every element of the 64 x 16 A operand of wgmma with A in registers lives
    (`wgmma_rs`: "A (64 x 16) in registers (4 b16x2 per thread, the mma.sync A layout in each
    warp's 16 rows)"): thread, warp, lane, the 32-bit register reg (0..3) and the half (0: low
    16 bits) holding it. Per warp, mma.sync.m16n8k16's A: a0 = (g, 2q..2q+1), a1 = (g + 8, 2q..),
    a2 = (g, 2q + 8..), a3 = (g + 8, 2q + 8..), on rows 16 w.."""
    t, reg, half = np.meshgrid(np.arange(WARPGROUP), np.arange(4), np.arange(2), indexing="ij")
    w, lane = t // WARP, t % WARP
    g, q = lane // 4, lane % 4
    df = pd.DataFrame(dict(row=(16 * w + g + 8 * (reg % 2)).ravel(),
                           col=(2 * q + half + 8 * (reg // 2)).ravel(), thread=t.ravel(),
                           warp=w.ravel(), lane=lane.ravel(), reg=reg.ravel(), half=half.ravel()))
    return df.sort_values(["row", "col"], ignore_index=True)


def p_repack(BC=64) -> pd.DataFrame:
    """P = the accumulator of S (64 x BC), rounded to 16 bits, is the A operand of O += P V with
    no data movement: 09_wgmma.cu's `p[ks][0] = pack2<T>(s[8 * ks], s[8 * ks + 1]);` (and
    p[ks][1..3] from s[8 ks + 2..7]). One row per element of P: the thread and d-register holding
    it in S, and the thread, k-step ks, register and half holding it as an A fragment. Asserts
    that the thread is always the same and that A register k, half h of k-step ks is
    s[8 ks + 2 k + h]."""
    acc = accumulator_owner(BC).rename(columns={"thread": "s_thread", "reg": "s_reg"})
    a = a_fragment_owner()
    parts = []
    for ks in range(BC // 16):
        part = a.assign(col=a["col"] + 16 * ks, ks=ks)
        parts.append(part.rename(columns={"thread": "a_thread", "reg": "a_reg", "half": "a_half"}))
    a = pd.concat(parts)[["row", "col", "a_thread", "ks", "a_reg", "a_half"]]
    df = acc[["row", "col", "s_thread", "s_reg"]].merge(a, on=["row", "col"], validate="1:1")
    assert (df.s_thread == df.a_thread).all(), "P would have to move between threads"
    assert (df.s_reg == 8 * df.ks + 2 * df.a_reg + df.a_half).all()
    return df.sort_values(["row", "col"], ignore_index=True)


def accumulator_figure(N=64, threads=(0, 5)):
    """The 64 x N accumulator of one wgmma.m64nNk16, cells coloured by the warp holding them, the
    elements of `threads` picked out. Right: rows 0-15, columns 0-15 (warp 0's first two 8-column
    tiles), each cell labelled with its lane T and register d[i] -- stage 05's mma.sync C fragment,
    which each warp repeats N/8 times along its own 16 rows."""
    _check_n(N)
    df = accumulator_owner(N)
    warp = df.pivot(index="row", columns="col", values="warp").to_numpy()
    shown = warp.copy()
    for k, t in enumerate(threads):
        mine = df[df.thread == t]
        shown[mine.row, mine.col] = 4 + k
    fig = Figure(figsize=(6.5 + 6.5 * N / 64, 8.2), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[N / 64 * 1.05, 1])
    cmap = ListedColormap(list(WARP_COLORS) + list(PICKED[:len(threads)]))
    left.imshow(shown, cmap=cmap, vmin=-0.5, vmax=cmap.N - 0.5, interpolation="nearest",
                aspect="equal")
    for x in range(8, N, 8):
        left.axvline(x - 0.5, color="0.45", lw=0.6)
    for y in range(8, M, 8):
        left.axhline(y - 0.5, color="k" if y % 16 == 0 else "0.45", lw=2.2 if y % 16 == 0 else 0.6)
    for w in range(4):
        left.text(N - 0.5 + N * 0.015, 16 * w + 7.5, f"warp {w}\nthreads\n{32 * w}–{32 * w + 31}",
                  ha="left", va="center", fontsize=TEXT)
    left.add_patch(Rectangle((-0.5, -0.5), 16, 16, fill=False, ec="k", lw=2, ls="--"))
    left.set_xticks(range(0, N, 8))
    left.set_yticks(range(0, M, 8))
    left.tick_params(labelsize=TEXT)
    left.set_xlabel("column n (thin lines: the 8-column tiles j = i // 4)", fontsize=LABEL)
    left.set_ylabel("row m", fontsize=LABEL)
    left.set_title(f"64 × {N} accumulator; dashed: the part enlarged on the right",
                   fontsize=LABEL)
    handles = [Patch(fc=c, ec="0.4", label=f"warp {w}") for w, c in enumerate(WARP_COLORS)]
    for k, t in enumerate(threads):
        w, lane = divmod(t, WARP)
        rows = sorted(df[df.thread == t].row.unique())
        handles.append(Patch(fc=PICKED[k], label=f"thread {t} (warp {w}, lane {lane}): rows "
                             f"{rows[0]}, {rows[1]}, d0..d{N // 2 - 1}"))
    left.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2,
                fontsize=TEXT, frameon=False)

    zoom = df[(df.row < 16) & (df.col < 16)]
    lane = zoom.pivot(index="row", columns="col", values="lane").to_numpy()
    reg = zoom.pivot(index="row", columns="col", values="reg").to_numpy()
    right.imshow(lane, cmap=LANES, vmin=0, vmax=LANES.N - 1, interpolation="nearest")
    thread = zoom.pivot(index="row", columns="col", values="thread").to_numpy()
    for (r, c), ln in np.ndenumerate(lane):
        right.text(c, r, f"T{ln}\nd{reg[r, c]}", ha="center", va="center", fontsize=8.5,
                   color="white" if _dark(LANES(ln)) else "black",
                   fontweight="bold" if thread[r, c] in threads else "normal")
    right.axvline(7.5, color="k", lw=2)
    right.axhline(7.5, color="k", lw=1)
    right.set_xticks(range(16))
    right.set_yticks(range(16))
    right.tick_params(labelsize=9, length=0)
    right.set_xlabel("column (tile j = 0 | tile j = 1)", fontsize=LABEL)
    right.set_ylabel("row (warp 0)", fontsize=LABEL)
    right.set_title("rows 0–15, columns 0–15: lane T, register d[i]\n(= mma.sync m16n8 C, "
                    "d[4j + r] in tile j)", fontsize=LABEL)
    fig.suptitle(f"wgmma m64nNk16 (here N = {N}): who holds which accumulator element\n"
                 f"128 threads = 4 warps; warp w holds rows 16w..16w+15; each thread holds "
                 f"N/2 = {N // 2} floats d[0..{N // 2 - 1}]", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- the matrix descriptor

class Field(NamedTuple):
    name: str
    lo: int        # first bit
    hi: int        # last bit (inclusive)
    shift: int     # the field holds value >> shift
    meaning: str


DESCRIPTOR_FIELDS = (
    Field("start_address", 0, 13, 4, "start address >> 4"),
    Field("leading_byte_offset", 16, 29, 4, "leading-dimension byte offset >> 4"),
    Field("stride_byte_offset", 32, 45, 4, "stride-dimension byte offset >> 4"),
    Field("base_offset", 49, 51, 0, "matrix base offset"),
    Field("swizzle", 62, 63, 0, "swizzle mode"),
)
SWIZZLE_MODES = {0: "none", 1: "128-byte", 2: "64-byte", 3: "32-byte"}


def _width(f):
    return f.hi - f.lo + 1


def encode_descriptor(addr, lead_bytes, stride_bytes, swizzle=1, base_offset=0) -> int:
    """The 64-bit wgmma matrix descriptor (PTX ISA, "Matrix Descriptor Format"; DESCRIPTOR_FIELDS).
    With the defaults it is hopper.cuh's `wgmma_desc(smem_addr, lead_bytes, stride_bytes)`:
    `return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | (uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16
    | ...` -- 128-byte swizzle, base offset 0. The kernel masks each byte value to 18 bits
    (shared memory is below 256 KiB) and drops the low 4 (16-byte units); here a value that would
    lose bits is an error instead."""
    values = dict(start_address=addr, leading_byte_offset=lead_bytes,
                  stride_byte_offset=stride_bytes, base_offset=base_offset, swizzle=swizzle)
    desc = 0
    for f in DESCRIPTOR_FIELDS:
        v = int(values[f.name])
        if v < 0 or v % (1 << f.shift) or v >> f.shift >= 1 << _width(f):
            unit = f" in {1 << f.shift}-byte units" if f.shift else ""
            raise ValueError(f"{f.name} = {v} does not fit bits {f.lo}-{f.hi}{unit}")
        desc |= (v >> f.shift) << f.lo
    return desc


def decode_descriptor(desc) -> dict:
    """The fields of a descriptor, as byte values for the three addresses (shifted back << 4),
    keyed by DESCRIPTOR_FIELDS' names: encode_descriptor(**...) of the same keys gives it back
    (swizzle as the mode number; SWIZZLE_MODES names it). Bits outside the fields must be 0."""
    desc = int(desc)
    if not 0 <= desc < 1 << 64:
        raise ValueError("a descriptor is 64 bits")
    out, used = {}, 0
    for f in DESCRIPTOR_FIELDS:
        mask = (1 << _width(f)) - 1
        out[f.name] = ((desc >> f.lo) & mask) << f.shift
        used |= mask << f.lo
    if desc & ~used:
        raise ValueError(f"bits {[b for b in range(64) if desc >> b & 1 and not used >> b & 1]} "
                         "are reserved (0)")
    return out


FIELD_COLORS = {"start_address": "#9ecae1", "leading_byte_offset": "#fdae6b",
                "stride_byte_offset": "#a1d99b", "base_offset": "#bcbddc", "swizzle": "#fc9272"}
FIELD_LABELS = {"start_address": "start address >> 4",
                "leading_byte_offset": "leading-dim byte offset >> 4",
                "stride_byte_offset": "stride-dim byte offset >> 4",
                "base_offset": "base offset", "swizzle": "swizzle"}


def descriptor_figure(desc=None):
    """The 64 bits of a wgmma matrix descriptor as two strips of 32 (bits 63..32 above 31..0, high
    bits on the left as a register is written), each field coloured and named with its bit range;
    grey bits are reserved (0). Given a descriptor, every bit's value and every field's value (in
    bytes for the three addresses)."""
    fig = Figure(figsize=(17, 5.4), layout="constrained")
    ax = fig.subplots()
    field_of = {b: f for f in DESCRIPTOR_FIELDS for b in range(f.lo, f.hi + 1)}
    values = decode_descriptor(desc) if desc is not None else None
    for half in (1, 0):                       # strip 1: bits 63..32 at y = 4; strip 0: 31..0 at 0
        y = 3.4 * half
        for k in range(32):
            bit = 32 * half + 31 - k
            f = field_of.get(bit)
            ax.add_patch(Rectangle((k, y), 1, 1, fc=FIELD_COLORS[f.name] if f else "0.88",
                                   ec="0.35", lw=0.8))
            if desc is None:
                ax.text(k + 0.5, y + 0.5, bit, ha="center", va="center", fontsize=10)
            else:
                ax.text(k + 0.5, y + 0.8, bit, ha="center", va="center", fontsize=8, color="0.3")
                ax.text(k + 0.5, y + 0.38, desc >> bit & 1, ha="center", va="center",
                        fontsize=13, fontweight="bold" if f else "normal",
                        color="k" if f else "0.5")
        for f in DESCRIPTOR_FIELDS:
            if f.lo // 32 != half:
                continue
            x0, x1 = 31 - (f.hi - 32 * half), 32 - (f.lo - 32 * half)
            ax.add_patch(Rectangle((x0, y), x1 - x0, 1, fill=False, ec="k", lw=2.2))
            ax.text((x0 + x1) / 2, y + 1.12, f"{FIELD_LABELS[f.name]}\nbits {f.lo}–{f.hi}",
                    ha="center", va="bottom", fontsize=TEXT if _width(f) > 4 else 9.5)
            if values is not None:
                v = values[f.name]
                what = (f"0x{v >> 4:x} × 16 = {v} bytes" if f.shift else
                        f"= {v}: {SWIZZLE_MODES[v]}" if f.name == "swizzle" else f"= {v}")
                ax.text((x0 + x1) / 2, y - 0.12, what, ha="center", va="top",
                        fontsize=TEXT if _width(f) > 4 else 9.5, color="k")
    ax.set_xlim(-0.3, 32.3)
    ax.set_ylim(-0.9, 6.3)
    ax.set_ylim(-0.9, 6.3)
    ax.axis("off")
    ax.legend(handles=[Patch(fc="0.88", ec="0.35", label="reserved: 0")]
              + [Patch(fc=FIELD_COLORS[f.name], ec="0.35", label=f.meaning)
                 for f in DESCRIPTOR_FIELDS], loc="upper center", bbox_to_anchor=(0.5, 0.0),
              ncol=6, fontsize=TEXT, frameon=False)
    head = "wgmma shared-memory matrix descriptor: 64 bits, addresses in 16-byte units"
    if desc is not None:
        head += f"\n0x{desc:016x}"
    else:
        head += "\nswizzle: 0 none, 1 = 128-byte, 2 = 64-byte, 3 = 32-byte"
    ax.set_title(head, fontsize=TITLE)
    return fig


def kernel_descriptors(D=128, BC=128, WGS=2, STAGES=3, smem=0) -> pd.DataFrame:
    """Every descriptor one warpgroup (wg 0) builds per K/V tile in 09_wgmma.cu (and 10_tma.cu),
    with the Q tile at byte `smem` (1024-aligned), K and V of buffer 0 after it as the kernel
    places them (the picks: D = 128 with BC = 128, WGS = 2, STAGES = 3; D = 64 with 64, 2, 4):
    for S = Q Kᵀ, k-step kk reads Q and K through descriptors that start in their 64-column
    block kk / 4, 32 bytes a k-step into its rows. For O += P V, k-step ks reads V through
    `wgmma_desc(Vt + ks * 16 * 128, BC * 128, 1024)`: 16 keys (2048 bytes) further each step,
    the leading offset BC * 128 the distance between V's 64-column blocks (MN-major)."""
    if smem % 1024:
        raise ValueError("the kernels start every tile on a 1024-byte boundary")
    BR = 64 * WGS
    Qs = smem
    Ks = Qs + BR * D * 2
    Vs = Ks + STAGES * BC * D * 2
    rows = []
    for kk in range(D // 16):
        blk, in_row = kk // 4, (kk % 4) * 32
        for op, addr in (("Q (A of S)", Qs + blk * BR * 128 + in_row),
                         ("K (B of S)", Ks + blk * BC * 128 + in_row)):
            rows.append(dict(product="S = Q Kᵀ", step=kk, operand=op, start=addr, lead=16,
                             stride=1024))
    for ks in range(BC // 16):
        rows.append(dict(product="O += P V", step=ks, operand="V (B, transposed)",
                         start=Vs + ks * 16 * 128, lead=BC * 128, stride=1024))
    df = pd.DataFrame(rows)
    df["descriptor"] = [f"0x{encode_descriptor(a, b, c):016x}"
                        for a, b, c in zip(df.start, df.lead, df.stride)]
    return df


# ---------------------------------------------------------------- the 128-byte swizzle

def sw128(rows, row, col):
    """Byte offset of 16-bit element (row, col) in a 128-byte-swizzled tile of `rows` rows, as
    hopper.cuh computes it: `(col / 64) * rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8))
    * 16) + (col % 8) * 2`. D/64 blocks of rows x 64 columns one after another (what TMA writes
    with a 64-column box); within a block, 16-byte chunk c of row r at chunk c ^ (r % 8).
    Vectorised over row and col (numpy arrays in, an array out)."""
    row, col = np.asarray(row), np.asarray(col)
    out = ((col // 64) * rows * ROW_BYTES + row * ROW_BYTES
           + (((col % 64) // 8) ^ (row % 8)) * CHUNK + (col % 8) * 2)
    return int(out) if out.ndim == 0 else out


def swz06(D, row, col):
    """Byte offset of 16-bit element (row, col) in stage 06's swizzled tile of D columns: rows D
    elements apart, 16-byte chunk col / 8 of a row stored at chunk (col / 8) XOR (row % 8), plus
    col % 8, times 2 bytes. Rows are 2 D bytes: 128 at D = 64, 256 at D = 128."""
    row, col = np.asarray(row), np.asarray(col)
    out = 2 * (row * D + (((col >> 3) ^ (row & 7)) << 3) + (col & 7))
    return int(out) if out.ndim == 0 else out


def swizzle128_address(addr):
    """What the hardware's 128-byte swizzle does to a shared-memory byte address: bits 4-6 (the
    16-byte chunk within 128 bytes) XOR bits 7-9 (which 128 bytes within 1024). sw128 is this
    applied to the unswizzled blocks of 128-byte rows, when the tile starts 1024-byte aligned --
    why the kernels align every tile to 1024 bytes and the descriptors' base offset stays 0."""
    addr = np.asarray(addr)
    out = addr ^ (((addr >> 7) & 7) << 4)
    return int(out) if out.ndim == 0 else out


def _layout_offset(layout, D, row, col, rows=M):
    if layout == "stage 06":
        return swz06(D, row, col)
    if layout == "wgmma 128B":
        return sw128(rows, row, col)
    raise ValueError(f"layout is 'stage 06' or 'wgmma 128B', not {layout!r}")


def swizzle_banks(D=128, first_row=0) -> pd.DataFrame:
    """One phase of an ldmatrix-like read (or of wgmma's own operand fetch): 8 consecutive rows,
    the same logical 16-byte chunk of each. For both layouts (stage 06's swz<D> and the 128-byte
    swizzle, in a 64-row tile) and every chunk of the row: the first of the 4 banks each row's
    chunk lands in (columns r0..r7), how many distinct banks the 8 rows touch (32: all of them)
    and the wavefronts the request takes (flashlab.banks; 1 = conflict-free)."""
    if D % 64:
        raise ValueError("both layouts take D a multiple of 64")
    rows = np.arange(first_row, first_row + 8)
    out = []
    for layout in ("stage 06", "wgmma 128B"):
        for c in range(D // 8):
            words = _layout_offset(layout, D, rows, np.full(8, 8 * c)) // BANK_BYTES
            banks = (words[:, None] + np.arange(CHUNK // BANK_BYTES)) % BANKS
            rec = dict(layout=layout, chunk=c)
            rec.update({f"r{k}": int(b) for k, b in enumerate(banks[:, 0])})
            rec["distinct_banks"] = len(np.unique(banks))
            rec["wavefronts"] = wavefronts(words, vector=CHUNK // BANK_BYTES)[0]
            out.append(rec)
    return pd.DataFrame(out)


def _unswizzled(layout, D, row, col, rows):
    """The same element's byte offset with no swizzle: stage 06's rows of 2 D bytes, or
    sw128's blocks of 128-byte rows."""
    if layout == "stage 06":
        return 2 * (row * D + col)
    return (col // 64) * rows * ROW_BYTES + row * ROW_BYTES + (col % 64) * 2


def _lines(layout, D, rows):
    """The first 8 rows of a tile as shared memory holds them, in 128-byte lines (a line spans
    the 32 banks once): [(byte offset of the line, logical row, its first column, the logical
    chunk at each of its 8 positions, whether that is the hardware's 128-byte swizzle)]; None
    where lines are left out (sw128's other rows between its 64-column blocks)."""
    out = {}
    for r in range(ATOM_ROWS):
        for c in range(D // 8):
            off = _layout_offset(layout, D, r, 8 * c, rows)
            line, pos = divmod(off, ROW_BYTES)
            entry = out.setdefault(line, [line * ROW_BYTES, r, 64 * (c // 8), np.zeros(8, int),
                                          True])
            entry[3][pos // CHUNK] = c
            entry[4] &= bool(off == swizzle128_address(_unswizzled(layout, D, r, 8 * c, rows)))
    lines = [out[k] for k in sorted(out)]
    if layout == "wgmma 128B" and D > 64:
        gaps = [None] * (rows > ATOM_ROWS)
        lines = [x for blk in range(D // 64)
                 for x in (gaps if blk else []) + lines[8 * blk:8 * blk + 8]]
    return lines


def _chunk_colors(n):
    """Chunk c and c + 8 share a hue (dark / light): they sit in the same 4 banks."""
    tab = matplotlib.colormaps["tab20"]
    return ListedColormap([tab(2 * (c % 8) + (c // 8) % 2) for c in range(n)])


def swizzle_figure(D=128, rows=64):
    """The first 8 rows of a tile as shared memory holds them, one 128-byte line (all 32 banks,
    4 per 16-byte chunk) per row of cells: stage 06's swz<D> against the 128-byte swizzle the
    wgmma descriptors name (sw128, a tile of `rows` rows). A cell's number and colour are the
    logical 16-byte chunk stored there; red outlines: chunk 0 of rows 0-7, one conflict-free read
    phase. ✓ marks a line laid out as the hardware's 128-byte swizzle lays it (chunk position =
    chunk ^ (line % 8), swizzle128_address). At D = 64 the two layouts are the same bytes; at
    D = 128 stage 06's 256-byte rows XOR only the low 3 bits of the chunk index with row % 8,
    which is not the hardware's pattern: sw128 splits the tile into two 64-column blocks."""
    if D % 64 or not 64 <= D <= 256:
        raise ValueError("D is 64, 128, 192 or 256")
    panels = [("stage 06", 64, "stage 06, D = 64\nswz<64>: 128-byte rows"),
              ("wgmma 128B", 64, "wgmma 128B, D = 64\nsw128: the same bytes")]
    if D > 64:
        panels += [("stage 06", D, f"stage 06, D = {D}\nswz<{D}>: {2 * D}-byte rows"),
                   ("wgmma 128B", D, f"wgmma 128B, D = {D}\nsw128: {D // 64} blocks of 64 "
                                     "columns")]
    tall = max(len(_lines(lay, d, rows)) for lay, d, _ in panels)
    fig = Figure(figsize=(4.6 * len(panels) + 1, (2.2 if D > 64 else 3.2) + 0.45 * tall),
                 layout="constrained")
    axes = fig.subplots(1, len(panels))
    for ax, (layout, d, title) in zip(axes, panels):
        lines = _lines(layout, d, rows)
        grid = np.full((len(lines), 8), np.nan)
        labels = []
        for k, line in enumerate(lines):
            if line is None:
                labels.append(f"⋮  rows 8–{rows - 1} of block 0")
                continue
            off, r, c0, chunks, hw = line
            grid[k] = chunks
            span = f", cols {c0}–{c0 + 63}" if d > 64 else ""  # c0: its first column
            labels.append(f"+{off}: row {r}{span}")
            for p, c in enumerate(chunks):
                ax.text(p, k, c, ha="center", va="center", fontsize=13,
                        fontweight="bold" if c == 0 else "normal")
                if c == 0 and r < ATOM_ROWS:
                    ax.add_patch(Rectangle((p - 0.5, k - 0.5), 1, 1, fill=False, ec="red", lw=3))
            ax.text(8.0, k, "✓" if hw else "✗", ha="center", va="center", fontsize=15,
                    color="tab:green" if hw else "tab:red", fontweight="bold")
        cmap = _chunk_colors(d // 8).with_extremes(bad="white")
        ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=-0.5, vmax=d // 8 - 0.5,
                  interpolation="nearest", aspect="equal")
        ax.set_yticks(range(len(lines)), labels, fontsize=10)
        ax.set_xticks(range(8), range(8), fontsize=TEXT)
        ax.set_xlabel("16-byte position in the line", fontsize=LABEL)
        top = ax.secondary_xaxis("top")
        top.set_xticks(range(8), [f"{4 * p}–\n{4 * p + 3}" for p in range(8)])
        top.tick_params(labelsize=9, length=0)
        top.set_xlabel("banks", fontsize=10)
        ax.set_xlim(-0.5, 8.5)
        ax.set_ylim(len(lines) - 0.5, -0.5)
        ax.set_title(title, fontsize=LABEL + 1)
        for s in ("top", "right"):
            ax.spines[s].set_visible(False)
    sep = "\n" if len(panels) < 4 else " "
    fig.suptitle("The first 8 rows of a tile in shared memory, 128 bytes (all 32 banks) a line:"
                 f"{sep}stage 06's XOR and the 128-byte swizzle of wgmma and TMA\nnumber: logical "
                 f"16-byte chunk (same hue: same banks); red: chunk 0 of 8 rows, read in one "
                 f"phase;{sep}✓: the hardware's pattern, chunk ^ (line % 8)", fontsize=TITLE - 1)
    return fig


# ---------------------------------------------------------------- TMA: boxes of a tensor map

def tma_boxes(N=300, D=128, BC=128, tile=2) -> pd.DataFrame:
    """The copies 10_tma.cu issues for K/V tile `tile`: D/64 boxes of 64 columns x BC rows,
    box blk from column blk * 64, row tile * BC, written blk * BC * 128 bytes into the buffer. Rows past
    N arrive as zeros and still count toward the mbarrier's expected bytes."""
    if D % 64:
        raise ValueError("a box is 64 columns (128 bytes, the most a 128-byte swizzle takes)")
    if not 1 <= BC <= 256:
        raise ValueError("a box dimension is 1 to 256 elements")
    if not 0 <= tile < math.ceil(N / BC):
        raise ValueError(f"N = {N} has {math.ceil(N / BC)} tiles of {BC} rows")
    row0 = tile * BC
    return pd.DataFrame([dict(box=b, col0=64 * b, row0=row0, rows=BC, dst=b * BC * ROW_BYTES,
                              bytes=BC * ROW_BYTES, zero_rows=max(0, row0 + BC - N))
                         for b in range(D // 64)])


BOX_COLORS = ("#6baed6", "#fd8d3c", "#74c476", "#9e9ac8")


def tma_box_figure(N=300, D=128, BC=128, tile=2):
    """Left: the K matrix of one (batch, head), N rows x D columns, cut into tiles of BC rows;
    tile `tile` is D/64 TMA boxes of 64 columns (one cp.async.bulk.tensor each), rows past N
    hatched: the copy engine writes zeros there. Right: where the boxes land in the buffer, one
    after another -- sw128's layout, each block a 128-byte-swizzled rows x 64 tile."""
    boxes = tma_boxes(N, D, BC, tile)
    n_tiles = math.ceil(N / BC)
    row0, zero = tile * BC, int(boxes.zero_rows.iloc[0])
    fig = Figure(figsize=(14, 8.5), layout="constrained")
    ax = fig.subplots()
    gap = 0.6 * D
    sx = D + gap                                   # x where shared memory is drawn
    # the matrix
    ax.add_patch(Rectangle((0, 0), D, N, fc="0.95", ec="k", lw=2))
    for k in range(n_tiles):
        top = k * BC
        ax.plot([0, D], [top, top], color="0.4", lw=1, ls="--")
        ax.text(-0.02 * D, top + min(BC, N - top) / 2,
                f"tile {k}\nrows {top}–{min(N, top + BC) - 1}", ha="right", va="center",
                fontsize=TEXT, fontweight="bold" if k == tile else "normal")
    for _, b in boxes.iterrows():
        c = BOX_COLORS[b.box % 4]
        ax.add_patch(Rectangle((b.col0, row0), 64, BC, fc=c, alpha=0.55, ec="k", lw=2.5))
        ax.text(b.col0 + 32, row0 + (BC - zero) / 2,
                f"box {b.box}: columns {b.col0}–{b.col0 + 63}\ncoordinates ({b.col0}, {row0}, "
                f"h, b)", ha="center", va="center", fontsize=TEXT)
        # where it lands
        y = b.box * BC
        ax.add_patch(Rectangle((sx, y), 64, BC, fc=c, alpha=0.55, ec="k", lw=2.5))
        ax.text(sx + 32, y + (BC - zero) / 2, f"box {b.box}: {BC} rows × 128 B\n"
                f"= {b.bytes // 1024} KiB, 128-byte swizzle",
                ha="center", va="center", fontsize=TEXT)
        ax.text(sx + 66, y + 2, f"+{b.dst} B", ha="left", va="top", fontsize=TEXT)
        ax.annotate("", (sx - 1.5, y + (BC - zero) / 2), (b.col0 + 32, row0 - 1),
                    arrowprops=dict(arrowstyle="-|>", color="0.2", lw=2,
                                    connectionstyle="arc3,rad=-0.25"))
        if zero:
            for x0, y0 in ((b.col0, N), (sx, y + BC - zero)):
                ax.add_patch(Rectangle((x0, y0), 64, zero, fc="white", ec="k", lw=1,
                                       hatch="//", alpha=0.9))
                ax.text(x0 + 32, y0 + zero / 2, f"zero fill\n{zero} rows", ha="center",
                        va="center", fontsize=TEXT, bbox=dict(fc="white", ec="none", pad=1))
    if zero:
        ax.text(-0.02 * D, N + zero / 2, f"rows {N}–{row0 + BC - 1}:\npast N, not in\nmemory",
                ha="right", va="center", fontsize=TEXT, color="0.3")
    ax.text(D / 2, -0.03 * N, f"K: {N} rows × {D} columns ({2 * D} B a row)", ha="center",
            va="bottom", fontsize=LABEL)
    ax.text(sx + 32, -0.03 * N, "shared memory: K buffer", ha="center", va="bottom",
            fontsize=LABEL)
    nbytes = BC * D * 2
    ax.text(sx + 32, len(boxes) * BC + 0.04 * N,
            f"{nbytes // 1024} KiB for K (and as much for V):\nfull[b] expects "
            f"2 × {nbytes} = {2 * nbytes} bytes,\nzero-filled rows included",
            ha="center", va="top", fontsize=TEXT)
    bottom = max(n_tiles * BC, len(boxes) * BC + 0.22 * N)
    ax.set_xlim(-0.42 * D, sx + 64 + 0.35 * D)
    ax.set_ylim(bottom + 0.02 * N, -0.1 * N)
    ax.axis("off")
    past = f"; rows {N}–{row0 + BC - 1} are past N = {N}" if zero else ""
    how = (f"is {len(boxes)} boxes of 64 columns × {BC} rows, one cp.async.bulk.tensor each, "
           "written one after another (sw128's layout)" if len(boxes) > 1 else
           f"is one box of 64 columns × {BC} rows: one cp.async.bulk.tensor, in sw128's layout")
    ax.set_title(f"TMA: tile {tile} of K (rows {row0}–{row0 + BC - 1}{past})\n{how}",
                 fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- the mbarrier ring

def _per_wg(value, warpgroups, name):
    vals = list(value) if np.ndim(value) else [value] * warpgroups
    if len(vals) != warpgroups or min(vals) < 0:
        raise ValueError(f"{name} is a time >= 0, or one per warpgroup")
    return [float(v) for v in vals]


def ring_schedule(n_tiles=8, stages=3, load=1.0, compute=1.5, latency=1.0, warpgroups=2):
    """A discrete-event model of 10_tma.cu's K/V loop (its shapes without RETIRE). Tile j lives in
    buffer j % stages; the elected thread (thread 0, in warpgroup 0) issues tiles 0..stages-2
    with Q before the loop, while no P V holds a buffer, and, at iteration j, right after issuing
    its S wgmma, tile j + AHEAD (AHEAD = stages - 2) into the buffer of tile j - 2 unless it came
    with Q, once that tile is released:
    `if (next >= STAGES) mbar_wait(empty + 8 * nb, (next / STAGES - 1) & 1);`. A copy starts
    arriving `latency` after its issue, then streams for `load` (copies share the link in issue
    order); full[b] completes when the last byte lands, and a warpgroup waits for it with
    parity (j / STAGES) & 1. A warpgroup's tile takes `compute` (one number, or one per
    warpgroup): half S = Q Kᵀ, half P V, which runs on while the next tile's S is issued; the
    wait for tile j + 1's S therefore also retires tile j's P V, and each warp then releases
    tile j (`mbar_arrive(empty + ...)`): empty[b] completes when every warp has. The elected
    thread's warp waits on empty before its own S wait, so a lagging warpgroup holds it up.
    Q's load before the loop is left out.

    Returns a row per tile: buffer, parity, issue, arrive, compute_start_wgW and compute_end_wgW
    per warpgroup, release (when empty[buffer] completes for it; the last tile, which the kernel
    never releases: when its last P V is done) and stall (how long the elected thread waited on
    empty before issuing it)."""
    if stages < 3:
        raise ValueError("the kernel needs stages >= 3 (AHEAD = stages - 2 >= 1)")
    if n_tiles < 1 or warpgroups < 1:
        raise ValueError("n_tiles and warpgroups are at least 1")
    if load < 0 or latency < 0:
        raise ValueError("load and latency are times >= 0")
    comp = _per_wg(compute, warpgroups, "compute")
    ahead = stages - 2
    issue, arrive, stall = {}, {}, {}
    link = 0.0

    def copy(j, when, waited=0.0):
        nonlocal link
        issue[j], stall[j] = when, waited
        link = max(when + latency, link) + load
        arrive[j] = link

    for j in range(min(stages - 1, n_tiles)):
        copy(j, 0.0)
    start = np.zeros((warpgroups, n_tiles))
    end = np.zeros((warpgroups, n_tiles))
    resume = np.zeros((warpgroups, n_tiles))   # when each warpgroup's wait for S(j) returns
    release = np.zeros(n_tiles)
    for j in range(n_tiles):
        for w in range(warpgroups):
            st = max(arrive[j], end[w, j - 1] if j else 0.0)
            s_done = st + comp[w] / 2
            res = s_done
            nxt = j + ahead
            if w == 0 and stages - 1 <= nxt < n_tiles:  # the elected thread, after issuing S(j)
                when = st
                if nxt >= stages:                # the buffer held tile j - 2
                    when = max(st, release[nxt - stages])
                copy(nxt, when, when - st)
                res = max(s_done, when)
            start[w, j], resume[w, j], end[w, j] = st, res, res + comp[w] / 2
        if j:
            release[j - 1] = resume[:, j].max()
    release[-1] = end[:, -1].max()
    df = pd.DataFrame(dict(tile=range(n_tiles), buffer=[j % stages for j in range(n_tiles)],
                           parity=[(j // stages) & 1 for j in range(n_tiles)],
                           issue=[issue[j] for j in range(n_tiles)],
                           arrive=[arrive[j] for j in range(n_tiles)]))
    for w in range(warpgroups):
        df[f"compute_start_wg{w}"] = start[w]
        df[f"compute_end_wg{w}"] = end[w]
    df["release"] = release
    df["stall"] = [stall[j] for j in range(n_tiles)]
    return df.set_index("tile")


WG_COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1")


def ring_timeline(n_tiles=8, stages=3, load=1.0, compute=1.5, latency=1.0, warpgroups=2):
    """ring_schedule on a time axis. Top lane: the elected thread, a marker per copy it issues
    (red: time spent waiting on empty first). One lane per buffer: a grey band while the buffer
    holds a tile (issue to release), the copy in flight (light: latency, hatched: queued behind
    earlier copies, dark: bytes streaming in) labelled with the tile, "full φp" where it lands
    (p: the phase parity the warps wait for), each warpgroup's compute of the tile as a thin bar,
    and a ▼ where every warp has released it (empty[b] completes that phase)."""
    df = ring_schedule(n_tiles, stages, load, compute, latency, warpgroups)
    comp = _per_wg(compute, warpgroups, "compute")
    fig = Figure(figsize=(16, 2.4 + 1.3 * (stages + 1)), layout="constrained")
    ax = fig.subplots()
    h = 0.84
    band = 0.34 / warpgroups
    for j, r in df.iterrows():
        y = r.buffer + 1                                   # lane centre; the elected thread is 0
        parity = int(r.parity)
        ax.broken_barh([(r.issue, r.release - r.issue)], (y - h / 2, h), color="0.92", lw=0)
        top = (y - 0.4, 0.34)                              # the copy, in the lane's upper half
        queued = r.arrive - load - (r.issue + latency)
        ax.broken_barh([(r.issue, latency)], top, color="#c6dbef", ec="0.3", lw=0.6)
        if queued > 1e-9:
            ax.broken_barh([(r.issue + latency, queued)], top, fc="white", ec="0.5", lw=0.6,
                           hatch="..")
        ax.broken_barh([(r.arrive - load, load)], top, color="#4292c6", ec="0.3", lw=0.6)
        ax.text((r.issue + r.arrive) / 2, y - 0.23, f"tile {j}", ha="center", va="center",
                fontsize=TEXT, fontweight="bold", bbox=dict(fc="white", ec="none", alpha=0.7,
                                                            pad=0.5))
        ax.text(r.arrive + 0.05, y - 0.23, f"full φ{parity}", ha="left", va="center",
                fontsize=TEXT, color="#08519c")
        for w in range(warpgroups):
            a, b = r[f"compute_start_wg{w}"], r[f"compute_end_wg{w}"]
            ax.broken_barh([(a, b - a)], (y + 0.02 + w * band, band * 0.85),
                           color=WG_COLORS[w % 4], lw=0)
        last = j == n_tiles - 1                            # nobody releases the last tile
        ax.plot([r.release], [y + h / 2 - 0.03], marker="|" if last else "v", color="k",
                ms=10, mew=2)
        ax.text(r.release + 0.06, y + h / 2 - 0.06, "last: done" if last else f"empty φ{parity}",
                ha="left", va="bottom", fontsize=10)
        if r.stall > 0:
            ax.broken_barh([(r.issue - r.stall, r.stall)], (-0.12, 0.24), color="tab:red", lw=0)
    for when, group in df.groupby("issue"):
        ax.plot([when], [0], marker="o", color="k", ms=8)
        ax.text(when, -0.2, "tile " + ", ".join(map(str, group.index)), ha="center",
                va="bottom", fontsize=TEXT)
    ax.set_yticks(range(stages + 1), ["elected\nthread issues"]
                  + [f"buffer {b}" for b in range(stages)], fontsize=LABEL)
    ax.set_ylim(stages + 0.5, -0.65)
    end = df[[c for c in df if c.startswith("compute_end")]].to_numpy().max()
    ax.set_xlim(-0.02 * end, end * 1.06)
    ax.set_xlabel("time", fontsize=LABEL)
    ax.tick_params(axis="x", labelsize=TEXT)
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(fc="#c6dbef", ec="0.3", label="copy: latency"),
               Patch(fc="white", ec="0.5", hatch="..", label="copy: queued"),
               Patch(fc="#4292c6", ec="0.3", label="copy: bytes arriving"),
               *[Patch(fc=WG_COLORS[w % 4], label=f"warpgroup {w} computes")
                 for w in range(warpgroups)],
               Patch(fc="0.92", label="buffer held"),
               Patch(fc="tab:red", label="elected thread waits on empty")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              ncol=min(len(handles), 7), fontsize=TEXT, frameon=False)
    ends = df[[c for c in df if c.startswith("compute_end")]].max(axis=1).to_numpy()
    half = n_tiles // 2
    per = (ends[-1] - ends[half - 1]) / (n_tiles - half) if n_tiles > 1 else ends[0]
    ahead = stages - 2
    ax.set_title(f"Stage 10's mbarrier ring: {stages} buffers, loads run {ahead} tile"
                 f"{'s' * (ahead > 1)} ahead; load {load:g}, latency {latency:g}, compute "
                 f"{'/'.join(f'{c:g}' for c in comp)} per tile\n{end:.3g} for {n_tiles} tiles, "
                 f"{per:.3g} a tile over the last {n_tiles - half} (compute alone: "
                 f"{max(comp):g}); φ: the phase parity waited on", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 11: registers per role

REGS_PER_SM = SM_LIMITS["9.0"][0]  # 32-bit registers in an SM's register file (65 536)
MAX_REGS_THREAD = 255    # the most a thread may hold
REG_UNIT = 8             # registers are allocated (and setmaxnreg counts) in multiples of 8
SETMAXNREG_RANGE = (24, 256)


def entry_registers(threads, regs_per_sm=REGS_PER_SM, blocks=1) -> int:
    """The registers a thread may hold when a kernel starts under `__launch_bounds__(threads,
    blocks)`: `blocks` blocks of `threads` must fit the register file, so 65 536 / blocks /
    threads, rounded down to a multiple of 8 and at most 255. ptxas compiles the whole kernel for
    this cap (it reports it as the kernel's registers); setmaxnreg moves it per warpgroup at run
    time."""
    if threads <= 0 or threads % WARPGROUP:
        raise ValueError("threads is a positive multiple of 128 (whole warpgroups)")
    if blocks < 1:
        raise ValueError("at least one block an SM")
    return min(MAX_REGS_THREAD, regs_per_sm // blocks // threads // REG_UNIT * REG_UNIT)


def producer_registers(consumers, blocks=1) -> int:
    """11_warpspec.cu's `static constexpr int PRODUCER_REGS = CONSUMERS == 3 || BLOCKS == 2 ? 32 :
    40;`: what its producer keeps after setmaxnreg.dec. 40 is what its loop needs at D = 128
    without spilling; with three consumers, or two blocks an SM, it gives up all but 32, so that
    each consumer gets 160 (or 104)."""
    if consumers < 1:
        raise ValueError("at least one consumer warpgroup")
    return 32 if consumers == 3 or blocks == 2 else 40


def consumer_registers(consumers, producer_regs=None, regs_per_sm=REGS_PER_SM, blocks=1) -> int:
    """11_warpspec.cu's split: `static constexpr int CONSUMER_REGS = (ENTRY_REGS * (1 +
    CONSUMERS) - PRODUCER_REGS) / CONSUMERS / 8 * 8;` -- setmaxnreg moves registers within the
    block's pool, what it was given at launch: ENTRY_REGS (entry_registers) for each of the
    128 thread positions of each warpgroup. The producer keeps PRODUCER_REGS and the consumers
    share the rest, each a multiple of 8 (setmaxnreg's unit)."""
    if consumers < 1:
        raise ValueError("at least one consumer warpgroup")
    pool = entry_registers(WARPGROUP * (1 + consumers), regs_per_sm, blocks) * (1 + consumers)
    producer_regs = (producer_registers(consumers, blocks) if producer_regs is None
                     else producer_regs)
    lo, hi = SETMAXNREG_RANGE
    if producer_regs % REG_UNIT or not lo <= producer_regs <= hi:
        raise ValueError(f"setmaxnreg takes a multiple of 8 from {lo} to {hi}, not {producer_regs}")
    regs = (pool - producer_regs) // consumers // REG_UNIT * REG_UNIT
    return min(regs, hi)


def accumulator_registers(D=128, BC=128) -> dict:
    """The registers a consumer thread's accumulators take in 11_warpspec.cu (stage 10's math):
    O (m64nD, fp32) `float o[D / 2]`, S (m64nBC) `float s[BC / 2]` and P packed to 16 bits as
    the A fragments of P V, `uint32_t p[KS][4]` with KS = BC / 16. Addresses, indices, the
    running max and sum come on top."""
    return {"O": D // 2, "S": BC // 2, "P": BC // 16 * 4}


def register_budget(consumers=2, producer_regs=None, regs_per_sm=REGS_PER_SM,
                    blocks=1) -> pd.DataFrame:
    """One row per warpgroup of one of 11_warpspec.cu's blocks (warpgroup 0 the producer, 1.. the
    consumers), `blocks` blocks an SM: threads, registers a thread at entry (entry_registers),
    after setmaxnreg (producer_regs, or consumer_registers), and the registers the warpgroup holds
    before and after. setmaxnreg only moves registers within the block: after <= entry in all."""
    threads = WARPGROUP * (1 + consumers)
    at_entry = entry_registers(threads, regs_per_sm, blocks)
    producer_regs = (producer_registers(consumers, blocks) if producer_regs is None
                     else producer_regs)
    cons = consumer_registers(consumers, producer_regs, regs_per_sm, blocks)
    rows = [dict(warpgroup=0, role="producer", threads=WARPGROUP, entry=at_entry,
                 after=producer_regs)]
    rows += [dict(warpgroup=w, role="consumer", threads=WARPGROUP, entry=at_entry, after=cons)
             for w in range(1, consumers + 1)]
    df = pd.DataFrame(rows)
    df["entry_total"] = df.threads * df.entry
    df["after_total"] = df.threads * df.after
    assert df.after_total.sum() <= df.entry_total.sum() <= regs_per_sm // blocks
    return df.set_index("warpgroup")


ROLE_COLORS = {"producer": "#fdae6b", "consumer": ("#6baed6", "#4292c6", "#2171b5", "#08519c")}


def register_figure(consumer_options=(2, 3), producer_regs=None, D=128, BC=128):
    """The SM's 65 536 registers as a bar, split by warpgroup (128 threads each), for each number
    of consumers in `consumer_options`: at entry (every warpgroup at the launch bound's cap) and
    after setmaxnreg (the producer down to `producer_regs`, default producer_registers: 40 for two
    consumers, 32 for three; the consumers up). Inside each
    consumer's share, hatched: the accumulators of stage 10's math at (D, BC) --
    accumulator_registers -- which must fit a thread's registers with room to spare."""
    need = sum(accumulator_registers(D, BC).values())
    bars = []
    for c in consumer_options:
        b = register_budget(c, producer_regs)
        kept = int(b.after.iloc[0])
        threads = WARPGROUP * (1 + c)
        bars.append((f"{c} consumers, at launch\n{threads} threads: "
                     f"{int(b.entry.iloc[0])} each", b, "entry"))
        bars.append((f"{c} consumers, after\nsetmaxnreg: {kept} | "
                     f"{int(b.after.iloc[1])}", b, "after"))
    fig = Figure(figsize=(16, 1.5 + 1.45 * len(bars)), layout="constrained")
    ax = fig.subplots()
    for y, (label, b, when) in enumerate(bars):
        x = 0
        for w, r in b.iterrows():
            per, total = int(r[when]), int(r[f"{when}_total"])
            fc = (ROLE_COLORS["producer"] if r.role == "producer"
                  else ROLE_COLORS["consumer"][(w - 1) % 4])
            ax.add_patch(Rectangle((x, y - 0.38), total, 0.76, fc=fc, ec="k", lw=1.2,
                                   alpha=0.45 if when == "entry" else 1.0))
            if r.role == "consumer":
                fits = need <= per
                ax.add_patch(Rectangle((x, y - 0.38), WARPGROUP * min(need, per), 0.3,
                                       fill=False, ec="k" if fits else "tab:red", lw=0.8,
                                       hatch="//"))
                left = per - need
                ax.text(x + WARPGROUP * min(need, per) / 2, y - 0.23,
                        f"accumulators {need}: {left} left" if fits else
                        f"accumulators {need} > {per}", ha="center", va="center", fontsize=9.5,
                        color="k" if fits else "tab:red",
                        bbox=dict(fc="white", ec="none", pad=0.6, alpha=0.9))
            name = "producer" if r.role == "producer" else f"consumer {w}"
            txt = f"wg {w}: {name}\n{per} × 128 = {total:,}".replace(",", " ")
            small = total < 9000
            ax.text(x + total / 2, y + 0.16 if not small else y, txt if not small else
                    f"wg {w}\n{per}/thread", ha="center", va="center", fontsize=TEXT - (2 if small
                                                                                    else 0),
                    color="white" if when == "after" and r.role == "consumer" and w > 1
                    else "black")
            x += total
        free = REGS_PER_SM - x
        if free > 0:
            ax.add_patch(Rectangle((x, y - 0.38), free, 0.76, fc="white", ec="0.5", lw=1,
                                   hatch=".."))
            if free > 2500:
                ax.text(x + free / 2, y, f"free\n{free:,}".replace(",", " "), ha="center",
                        va="center", fontsize=TEXT - 1, color="0.3")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=TEXT)
    ax.set_ylim(len(bars) - 0.45, -0.55)
    ax.set_xlim(0, REGS_PER_SM)
    ax.set_xticks(range(0, REGS_PER_SM + 1, 8192),
                  [f"{v:,}".replace(",", " ") for v in range(0, REGS_PER_SM + 1, 8192)],
                  fontsize=TEXT)
    ax.set_xlabel("registers of one SM (one block per SM)", fontsize=LABEL)
    parts = accumulator_registers(D, BC)
    handles = [Patch(fc=ROLE_COLORS["producer"], ec="k", label="producer: issues the copies"),
               Patch(fc=ROLE_COLORS["consumer"][0], ec="k", label="consumers: the math"),
               Patch(fc="white", ec="k", hatch="//",
                     label=f"a consumer thread's accumulators at D = {D}: O {parts['O']} + S "
                           f"{parts['S']} + P {parts['P']} = {need} registers (red: do not fit)"),
               Patch(fc="white", ec="0.5", hatch="..", label="not allocated")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
              fontsize=TEXT, frameon=False)
    ax.set_title("setmaxnreg: the SM's 65 536 registers, split by warpgroup (128 threads "
                 "each)\nlight: at launch, every warpgroup at __launch_bounds__(threads, 1)'s cap; "
                 "solid: after setmaxnreg.dec / .inc", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 11: claiming work items

CLAIM_POLICIES = ("static", "counter", "hardware")


def item_tiles(item, tiles, causal, longest_first=True, rows=128, keys=128, n=None) -> int:
    """The key tiles (of `keys` keys) work item `item` reads, its query tiles `rows` rows each, in
    a sequence of n keys (default tiles x rows). 11_warpspec.cu's work_tile gives it query tile
    qt = item % tiles of its head, taken from the last under the causal mask; a causal item reads the key tiles up to its last row,
    ceil(min(n, q0 + rows) / keys), and without the mask every item reads all ceil(n / keys).
    With rows = keys, causal query tile t reads key tiles 0..t. longest_first=False numbers the
    tiles in order instead (short ones first)."""
    if rows < 1 or keys < 1:
        raise ValueError("rows and keys are at least 1")
    n = tiles * rows if n is None else n
    if not (tiles - 1) * rows < n <= tiles * rows:
        raise ValueError(f"{tiles} query tiles of {rows} rows do not cover a sequence of {n}")
    if not causal:
        return math.ceil(n / keys)
    qt = item % tiles
    q0 = (tiles - 1 - qt if longest_first else qt) * rows
    return math.ceil(min(n, q0 + rows) / keys)


def claim_schedule(heads=4, tiles=8, blocks=8, causal=True, policy="counter", longest_first=True,
                   per_item=0.0, ahead=2, rows=128, keys=128, n=None) -> pd.DataFrame:
    """Which block (SM) computes which work item, and when, for `heads` (batch x head) of `tiles`
    query tiles each, an item taking item_tiles() time units (+ `per_item`; rows, keys and n as
    there). Policies:

    * "static": a persistent grid without a counter, block b taking items b, b + G, b + 2G, ...
      (G = the grid's blocks);
    * "counter": 11_warpspec.cu. Block b's first item is its own (`int ring = 0, item =
      blockIdx.x;`); its producer claims the next one once it has issued the current item's
      copies (`item = gridDim.x + atomicAdd(next_item, 1);`). It issues the last of them when a
      buffer of the K/V ring frees up, `ahead` key tiles before the item ends (the ring's depth),
      so the claim comes at max(start, end - ahead) and the claimed item starts when the current
      one ends; claims are served in the order they are made;
    * "hardware": one block per item as in stage 10, the block scheduler starting block i on the
      first SM to free up (items in order).

    A row per item: head, qt (the query tile work_tile gives it), cost, block, claimed (time),
    start, end."""
    if policy not in CLAIM_POLICIES:
        raise ValueError(f"policy is one of {CLAIM_POLICIES}, not {policy!r}")
    if heads < 1 or tiles < 1 or blocks < 1 or per_item < 0 or ahead < 0:
        raise ValueError("heads, tiles and blocks are at least 1; per_item and ahead >= 0")
    items = heads * tiles
    cost = [item_tiles(i, tiles, causal, longest_first, rows, keys, n) + per_item
            for i in range(items)]
    grid = min(blocks, items)
    start, end, claimed = np.zeros(items), np.zeros(items), np.zeros(items)
    block = np.zeros(items, dtype=int)
    if policy == "static":
        for b in range(grid):
            t = 0.0
            for i in range(b, items, grid):
                start[i], end[i], block[i] = t, t + cost[i], b
                t = end[i]
    elif policy == "hardware":
        free = [(0.0, b) for b in range(grid)]
        for i in range(items):
            t, b = heapq.heappop(free)
            claimed[i], start[i], end[i], block[i] = t, t, t + cost[i], b
            heapq.heappush(free, (end[i], b))
    else:
        counter = grid
        events = []                 # (when the block claims, block, the item it is on): in that order
        for b in range(grid):
            start[b], end[b], block[b] = 0.0, cost[b], b
            heapq.heappush(events, (max(0.0, end[b] - ahead), b, b))
        while events:
            t, b, cur = heapq.heappop(events)
            if counter >= items:
                continue                    # the block read -1: no items left, it stops
            i, counter = counter, counter + 1
            claimed[i] = t
            start[i], end[i], block[i] = end[cur], end[cur] + cost[i], b
            heapq.heappush(events, (max(start[i], end[i] - ahead), b, i))
    qt = [(tiles - 1 - i % tiles if causal and longest_first else i % tiles) for i in range(items)]
    return pd.DataFrame(dict(item=range(items), head=[i // tiles for i in range(items)], qt=qt,
                             cost=cost, block=block, claimed=claimed, start=start,
                             end=end)).set_index("item")


def claim_makespans(configs, blocks=132, causal=True) -> pd.DataFrame:
    """For each (heads, tiles) or (heads, tiles, rows, keys, n) in `configs` (claim_schedule's
    arguments): when the last item ends under each policy, in units of one key tile's work,
    beside the lower bound (all the work spread evenly over the blocks) and each policy's excess
    over it."""
    out = []
    for heads, tiles, *shape in configs:
        shape = dict(zip(("rows", "keys", "n"), shape))
        sched = {p: claim_schedule(heads, tiles, blocks, causal, p, **shape)
                 for p in CLAIM_POLICIES}
        grid = min(blocks, heads * tiles)
        bound = sched["counter"].cost.sum() / grid
        row = dict(heads=heads, tiles=tiles, items=heads * tiles, even_split=bound)
        for p, s in sched.items():
            row[p] = s.end.max()
        for p in CLAIM_POLICIES:
            row[f"{p} over even"] = row[p] / bound - 1
        out.append(row)
    return pd.DataFrame(out).set_index(["heads", "tiles"])


def claim_figure(heads=4, tiles=8, blocks=8, causal=True):
    """claim_schedule as Gantt charts, a panel per way of handing out the same causal items: a
    row per block (SM), a bar per item labelled with its key tiles (its time), coloured by head;
    a dashed line where all the work spread evenly would end. Panels: the static assignment, the
    counter with query tiles in order (short first), the counter with work_tile's order
    (longest first: what stage 11 does), and stage 10's one block per item."""
    panels = [("static", True, "persistent grid, static: block b takes items b, b + G, b + 2G, …"),
              ("counter", False, "counter, query tiles in order (short ones first)"),
              ("counter", True, "counter, longest first (11_warpspec.cu's work_tile)"),
              ("hardware", True, "one block per item (stage 10): the block scheduler fills the "
                                 "first free SM")]
    scheds = [claim_schedule(heads, tiles, blocks, causal, p, lf) for p, lf, _ in panels]
    span = max(s.end.max() for s in scheds)
    fig = Figure(figsize=(16, 2.4 + 0.3 * blocks * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True)
    cmap = matplotlib.colormaps["Pastel1" if heads <= 9 else "tab20"]
    for ax, s, (_, _, title) in zip(axes, scheds, panels):
        bound = s.cost.sum() / min(blocks, len(s))
        for i, r in s.iterrows():
            ax.broken_barh([(r.start, r.cost)], (r.block - 0.4, 0.8),
                           fc=cmap(int(r["head"]) % cmap.N), ec="0.25", lw=0.8)
            if r.cost >= 0.6:
                ax.text(r.start + r.cost / 2, r.block, f"{r.cost:g}", ha="center", va="center",
                        fontsize=TEXT - 1)
        ax.axvline(bound, color="k", ls="--", lw=1.2)
        last = s.end.max()
        ax.axvline(last, color="tab:red", lw=2)
        ax.set_title(f"{title}: done at {last:g} ({last / bound - 1:+.0%} over the even split, "
                     f"{bound:.3g})", fontsize=LABEL, loc="left")
        ax.set_yticks(range(blocks), [f"SM {b}" for b in range(blocks)], fontsize=9)
        ax.set_ylim(blocks - 0.5, -0.5)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlim(0, span * 1.02)
    axes[-1].set_xlabel("time, in key tiles of work (a bar's number: the key tiles its item reads)",
                        fontsize=LABEL)
    axes[-1].tick_params(axis="x", labelsize=TEXT)
    handles = [Patch(fc=cmap(h % cmap.N), ec="0.25", label=f"head {h}") for h in range(heads)]
    handles += [matplotlib.lines.Line2D([], [], color="k", ls="--", label="all work spread evenly"),
                matplotlib.lines.Line2D([], [], color="tab:red", lw=2, label="last item done")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8),
               fontsize=TEXT, frameon=False)
    fig.suptitle(f"Handing out {heads * tiles} causal work items ({heads} heads × {tiles} query "
                 f"tiles; query tile t reads t + 1 key tiles) to {blocks} SMs", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 11: producer and consumers

class _CopyEngine:
    """Copies in issue order: each starts arriving `latency` after its issue and then streams its
    bytes (a time) behind the copies issued before it (they share the link), as in
    ring_schedule."""

    def __init__(self, latency):
        self.latency, self.link, self.rows = latency, 0.0, []

    def issue(self, when, duration, **what):
        start = max(when + self.latency, self.link)
        self.link = start + duration
        self.rows.append(dict(issue=when, start=start, arrive=self.link, **what))
        return self.link


def _check_times(**times):
    for name, v in times.items():
        if v < 0:
            raise ValueError(f"{name} is a time >= 0, not {v}")


class Schedule(NamedTuple):
    """What elected_schedule and warpspec_schedule return: `work`, a row per interval a lane
    spends (lane, kind, item, tile, start, end; kinds: launch, S, softmax, PV, store, wait),
    `copies`, a row per copy (what, item, tile, buffer, issue, start, arrive, release), and
    `total`, when the last item's O is stored."""
    work: pd.DataFrame
    copies: pd.DataFrame
    total: float


def elected_schedule(tiles=(4, 4, 4), stages=3, load=1.0, latency=1.0, mma=0.75, softmax=0.75,
                     q_load=0.5, store=0.5, launch=0.5, issue=0.05, warpgroups=2) -> Schedule:
    """Stage 10 on one SM, one block at a time (its shared memory at D = 128 leaves room for one):
    a block per work item, item k of tiles[k] K/V tiles. A block starts (`launch`: the block is
    placed, its barriers initialised), its elected thread (thread 0, in warpgroup 0) issues Q
    (`q_load` of bytes) and the first stages - 1 tiles (K and V together, `load`), each
    taking it `issue`. Each warpgroup, per tile: waits for full (Q too, before tile 0), S = Q Kᵀ
    (mma / 2), softmax, P V (mma / 2; the next S waits for it). Right after issuing S(j), the
    elected thread waits on empty for the buffer of tile j - 2 and issues tile j + AHEAD
    (AHEAD = stages - 2) unless it came with Q (10_tma.cu's ring, as ring_schedule), so its
    warpgroup resumes only when both S and the issue are done; a buffer is released when every
    warpgroup's S of the next tile has retired (the last one when its P V has). After its last
    tile a warpgroup stores its rows of O (`store`); the block ends when both have, and the next
    block starts."""
    _check_times(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    if stages < 3:
        raise ValueError("stage 10 needs stages >= 3 (AHEAD = stages - 2 >= 1)")
    if not tiles or min(tiles) < 1 or warpgroups < 1:
        raise ValueError("every item has at least one tile; at least one warpgroup")
    ahead = stages - 2
    eng = _CopyEngine(latency)
    work, copies = [], []
    t_block = 0.0
    for k, n in enumerate(tiles):
        for w in range(warpgroups):
            work.append(dict(lane=f"wg {w}", kind="launch", item=k, tile=-1, start=t_block,
                             end=t_block + launch))
        t = t_block + launch                              # the elected thread's clock
        t += issue
        q_arrive = eng.issue(t, q_load, what="Q", item=k, tile=-1, buffer=0)
        arrive, release = {}, {}
        for j in range(min(stages - 1, n)):
            t += issue
            arrive[j] = eng.issue(t, load, what="KV", item=k, tile=j, buffer=j % stages)
        free = [t_block + launch] * warpgroups
        for j in range(n):
            s_done = []
            for w in range(warpgroups):
                ready = max(arrive[j], q_arrive if j == 0 else 0.0)
                st = max(free[w], ready)
                if st > free[w]:
                    work.append(dict(lane=f"wg {w}", kind="wait", item=k, tile=j, start=free[w],
                                     end=st))
                s_end = st + mma / 2
                resume = s_end
                nxt = j + ahead
                if w == 0 and stages - 1 <= nxt < n:      # the elected thread, after issuing S(j)
                    when = max(st, t)
                    if nxt >= stages:
                        when = max(when, release[nxt - stages])
                    if when > st:
                        work.append(dict(lane="elected", kind="wait", item=k, tile=nxt, start=st,
                                         end=when))
                    t = when + issue
                    arrive[nxt] = eng.issue(t, load, what="KV", item=k, tile=nxt,
                                            buffer=nxt % stages)
                    resume = max(s_end, t)
                work.append(dict(lane=f"wg {w}", kind="S", item=k, tile=j, start=st, end=s_end))
                if resume > s_end:
                    work.append(dict(lane=f"wg {w}", kind="wait", item=k, tile=j, start=s_end,
                                     end=resume))
                work.append(dict(lane=f"wg {w}", kind="softmax", item=k, tile=j, start=resume,
                                 end=resume + softmax))
                pv_end = resume + softmax + mma / 2
                work.append(dict(lane=f"wg {w}", kind="PV", item=k, tile=j,
                                 start=resume + softmax, end=pv_end))
                free[w] = pv_end
                s_done.append(resume)
            if j:
                release[j - 1] = max(s_done)
        release[n - 1] = max(free)
        for w in range(warpgroups):
            work.append(dict(lane=f"wg {w}", kind="store", item=k, tile=n, start=free[w],
                             end=free[w] + store))
        for row in eng.rows[len(copies):]:
            row["release"] = (release[row["tile"]] if row["tile"] >= 0
                              else max(free))     # Q: the block's end
        copies = list(eng.rows)
        t_block = max(free) + store
    return Schedule(pd.DataFrame(work), pd.DataFrame(copies), t_block)


def warpspec_schedule(tiles=(4, 4, 4), stages=2, load=1.0, latency=1.0, mma=0.75, softmax=0.75,
                      q_load=0.5, store=0.5, launch=0.5, issue=0.05, consumers=2) -> Schedule:
    """Stage 11 on one SM: one persistent block computes the work items one after another
    (tiles[k] K/V tiles each). It starts once (`launch`). The producer's one thread walks the
    items in 11_warpspec.cu's order: for item `it`, it waits until Q buffer it % 2 is free (item
    it - 2's last S has retired: `if (it >= 2) mbar_wait(q_empty + 8 * slot, ((it >> 1) - 1) &
    1);`), issues Q, then K_0, then K_j with V_{j-1} (`if (j > 0) load(Vs, v_full, v_empty,
    maps.v, j - 1);`), then the last V -- K and V of a tile load / 2 each, on rings of `stages`
    buffers with barriers of their own, each copy waiting for its buffer's release and taking
    the thread issue / 2. Each consumer, per tile: waits for K_j, S (mma / 2), then releases K_j
    and V_{j-1} (`mbar_arrive(k_empty + 8 * buf);`: its S and the P V before it have retired),
    softmax, waits for V_j, P V (mma / 2); after an item's last tile it stores O from its
    registers (`store`) and waits for the next item's Q. A buffer is free once every consumer
    has released it; Q's once every consumer's last S of the item has retired."""
    _check_times(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    if stages < 2:
        raise ValueError("stage 11 needs stages >= 2 (the producer loads K_j with V_{j-1})")
    if not tiles or min(tiles) < 1 or consumers < 1:
        raise ValueError("every item has at least one tile; at least one consumer")
    eng = _CopyEngine(latency)
    base = [int(b) for b in np.concatenate([[0], np.cumsum(tiles)])]  # ring position of tile 0
    positions = [(k, j) for k, n in enumerate(tiles) for j in range(n)]
    q_arrive, q_release = {}, {}
    arrive = {"K": {}, "V": {}}
    release = {"K": {}, "V": {}}
    work = [dict(lane=lane, kind="launch", item=0, tile=-1, start=0.0, end=launch)
            for lane in ["producer"] + [f"consumer {c + 1}" for c in range(consumers)]]
    free = [launch] * consumers
    state = {"done": -1, "t": launch}              # positions consumed; the producer's clock

    def consume(r):
        """The consumers' work on ring position r (its copies are issued)."""
        k, j = positions[r]
        n = tiles[k]
        s_end, pv_end = [], []
        for c in range(consumers):
            lane = f"consumer {c + 1}"
            if j == 0 and q_arrive[k] > free[c]:
                work.append(dict(lane=lane, kind="wait", item=k, tile=-1, start=free[c],
                                 end=q_arrive[k]))
                free[c] = q_arrive[k]
            st = max(free[c], arrive["K"][r])
            if st > free[c]:
                work.append(dict(lane=lane, kind="wait", item=k, tile=j, start=free[c], end=st))
            sm = st + mma / 2
            work.append(dict(lane=lane, kind="S", item=k, tile=j, start=st, end=sm))
            work.append(dict(lane=lane, kind="softmax", item=k, tile=j, start=sm,
                             end=sm + softmax))
            pv = max(sm + softmax, arrive["V"][r])
            if pv > sm + softmax:
                work.append(dict(lane=lane, kind="wait", item=k, tile=j, start=sm + softmax,
                                 end=pv))
            work.append(dict(lane=lane, kind="PV", item=k, tile=j, start=pv, end=pv + mma / 2))
            free[c] = pv + mma / 2
            s_end.append(sm)
            pv_end.append(free[c])
            if j == n - 1:
                work.append(dict(lane=lane, kind="store", item=k, tile=n, start=free[c],
                                 end=free[c] + store))
                free[c] += store
        release["K"][r] = max(s_end)
        if j > 0:
            release["V"][r - 1] = max(s_end)
        if j == n - 1:
            q_release[k] = max(s_end)
            release["V"][r] = max(pv_end)

    def consume_upto(r):
        while state["done"] < r:
            nxt = state["done"] + 1
            k, _ = positions[nxt]
            if k not in q_arrive or nxt not in arrive["K"] or nxt not in arrive["V"]:
                raise RuntimeError("model deadlock: a consumer needs a copy not issued yet")
            consume(nxt)
            state["done"] = nxt

    def wait_until(when, k, tile):
        if when > state["t"]:
            work.append(dict(lane="producer", kind="wait", item=k, tile=tile, start=state["t"],
                             end=when))
            state["t"] = when

    def copy(kind, r):
        k, j = positions[r]
        if r >= stages:                            # the buffer's last tile must be released
            old = r - stages
            last_of_item = positions[old][1] == tiles[positions[old][0]] - 1
            consume_upto(old if kind == "K" or last_of_item else old + 1)
            wait_until(release[kind][old], k, j)
        state["t"] += issue / 2
        arrive[kind][r] = eng.issue(state["t"], load / 2, what=kind, item=k, tile=j,
                                    buffer=r % stages)

    for k, n in enumerate(tiles):
        if k >= 2:                                 # Q buffer k % 2 held item k - 2's Q
            consume_upto(base[k - 1] - 1)
            wait_until(q_release[k - 2], k, -1)
        state["t"] += issue / 2
        q_arrive[k] = eng.issue(state["t"], q_load, what="Q", item=k, tile=-1, buffer=k % 2)
        for j in range(n):
            copy("K", base[k] + j)
            if j > 0:
                copy("V", base[k] + j - 1)
        copy("V", base[k] + n - 1)
    consume_upto(len(positions) - 1)
    rows = []
    for row in eng.rows:
        k, j = row["item"], row["tile"]
        rel = q_release[k] if row["what"] == "Q" else release[row["what"]][base[k] + j]
        rows.append(dict(row, release=rel))
    return Schedule(pd.DataFrame(work), pd.DataFrame(rows), max(free))


def predicted_gain(n_tiles=(4, 8, 16, 32, 64, 128), items=6, **times) -> pd.Series:
    """Stage 10's time over stage 11's, per number of K/V tiles in a work item, from
    elected_schedule and warpspec_schedule with the same times (keyword arguments of both), for
    `items` items of that many tiles on one SM (stage 10 at 3 buffers, stage 11 at 2, as both
    kernels pick at D = 128)."""
    return _gain(n_tiles, items, "stage 10 time / stage 11 time",
                 lambda tiles: elected_schedule(tiles=tiles, stages=3, **times).total,
                 lambda tiles: warpspec_schedule(tiles=tiles, stages=2, **times).total)


def _gain(n_tiles, items, name, before, after) -> pd.Series:
    """before(tiles) / after(tiles), the two schedules' totals for `items` work items of n tiles
    each, per n in n_tiles."""
    out = {n: before((n,) * items) / after((n,) * items) for n in n_tiles}
    return pd.Series(out, name=name).rename_axis("tiles per item")


ITEM_COLORS = ("#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363")


def _lighter(color, amount=0.55):
    r, g, b = matplotlib.colors.to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _draw_work(ax, work, lanes, h=0.7):
    """A schedule's intervals on lanes {lane: y}: S and P V dark, softmax light, the store
    hatched (all in the item's colour), waits red, a block's start grey."""
    for _, r in work.iterrows():
        if r.lane not in lanes or r.end - r.start <= 1e-9:
            continue
        y = lanes[r.lane]
        c = ITEM_COLORS[int(r["item"]) % len(ITEM_COLORS)]
        span = [(r.start, r.end - r.start)]
        if r.kind in ("S", "PV"):
            ax.broken_barh(span, (y - h / 2, h), fc=c, ec="white", lw=0.6)
            if r.end - r.start > 0.3:
                ax.text((r.start + r.end) / 2, y, f"{r.kind}{int(r.tile)}", ha="center",
                        va="center", fontsize=8.5, color="white")
        elif r.kind == "softmax":
            ax.broken_barh(span, (y - h / 2, h), fc=_lighter(c), ec="white", lw=0.6)
            if r.end - r.start > 0.5:
                ax.text((r.start + r.end) / 2, y, "exp", ha="center", va="center", fontsize=8.5)
        elif r.kind == "store":
            ax.broken_barh(span, (y - h / 2, h), fc="white", ec=c, lw=1, hatch="///")
        elif r.kind == "launch":
            ax.broken_barh(span, (y - h / 2, h), fc="0.8", ec="0.5", lw=0.6)
        elif r.kind == "wait":
            ax.broken_barh(span, (y - 0.09, 0.18), fc="tab:red", lw=0)


def _draw_copies(ax, copies, issuer_y, land_y, h=0.6):
    """Each copy: a marker where it is issued (on the issuer's lane) and its bytes arriving (on
    the landing lane, between start and arrive), labelled and coloured by item."""
    for n, r in enumerate(copies.itertuples()):
        c = ITEM_COLORS[int(r.item) % len(ITEM_COLORS)]
        name = "Q" if r.what == "Q" else f"{r.what}{int(r.tile)}"
        ax.plot([r.issue], [issuer_y], marker="v", color=c, ms=8, mec="k", mew=0.5)
        ax.broken_barh([(r.start, r.arrive - r.start)], (land_y - h / 2, h), fc=c, ec="k",
                       lw=0.6, alpha=0.85)
        ax.text((r.start + r.arrive) / 2, land_y + (-0.5 if n % 2 else 0.5), name,
                ha="center", va="center", fontsize=8.5, color=c, fontweight="bold")


def warpspec_timeline(tiles=(3, 3, 3), load=0.5, latency=1.0, mma=1.0, softmax=1.0, q_load=0.25,
                      store=0.25, launch=0.5, issue=0.05):
    """elected_schedule (stage 10, 3 buffers, one block per item) above warpspec_schedule (stage
    11, 2 buffers of K and 2 of V, one persistent block) for the same items and times, on one
    time axis. Lanes: who issues the copies (a ▼ per copy, red while it waits for a buffer), the
    copies' bytes landing, stage 11's two Q buffers (held from Q's issue to its release), and the
    computing warpgroups: S and P V dark, the softmax light, O's store hatched, red while
    waiting for data; items by colour."""
    times = dict(load=load, latency=latency, mma=mma, softmax=softmax, q_load=q_load,
                 store=store, launch=launch, issue=issue)
    ten = elected_schedule(tiles=tiles, stages=3, **times)
    eleven = warpspec_schedule(tiles=tiles, stages=2, **times)
    end = max(ten.total, eleven.total)
    fig = Figure(figsize=(16, 9.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[4, 6])
    lanes10 = {"elected": 0, "copies": 1, "wg 0": 2, "wg 1": 3}
    _draw_copies(top, ten.copies, 0, 1)
    _draw_work(top, ten.work, lanes10)
    for item, start in ten.work[ten.work.kind == "launch"].groupby("item").start.min().items():
        top.axvline(start, color="0.4", ls=":", lw=1)
        top.text(start + 0.05, -0.65, f"block {item} starts", fontsize=9.5, color="0.3",
                 va="bottom")
    top.set_yticks(list(lanes10.values()), ["elected thread\n(in warpgroup 0)", "copies land",
                                            "warpgroup 0", "warpgroup 1"], fontsize=TEXT)
    top.set_ylim(3.6, -0.8)
    top.set_title(f"Stage 10: a block per item, one thread of warpgroup 0 issues the copies — "
                  f"{len(tiles)} items in {ten.total:.3g}", fontsize=LABEL + 1, loc="left")
    lanes11 = {"producer": 0, "copies": 1, "Q 0": 2, "Q 1": 3, "consumer 1": 4, "consumer 2": 5}
    _draw_copies(bottom, eleven.copies, 0, 1)
    _draw_work(bottom, eleven.work, lanes11)
    for r in eleven.copies[eleven.copies.what == "Q"].itertuples():
        c = ITEM_COLORS[int(r.item) % len(ITEM_COLORS)]
        y = 2 + int(r.buffer)
        bottom.broken_barh([(r.issue, r.release - r.issue)], (y - 0.3, 0.6), fc=_lighter(c, 0.7),
                           ec=c, lw=1)
        bottom.broken_barh([(r.start, r.arrive - r.start)], (y - 0.3, 0.6), fc=c, lw=0)
        bottom.text(r.arrive + 0.1, y, f"item {int(r.item)}'s Q", fontsize=9.5, va="center",
                    color=c)
    bottom.set_yticks(list(lanes11.values()), ["producer\n(one thread)", "copies land",
                                               "Q buffer 0", "Q buffer 1", "consumer 1",
                                               "consumer 2"], fontsize=TEXT)
    bottom.set_ylim(5.6, -0.8)
    bottom.set_title(f"Stage 11: one persistent block; the producer warpgroup issues, two "
                     f"consumer warpgroups compute — {len(tiles)} items in {eleven.total:.3g}",
                     fontsize=LABEL + 1, loc="left")
    bottom.set_xlim(-0.02 * end, end * 1.02)
    bottom.set_xlabel("time", fontsize=LABEL)
    bottom.tick_params(axis="x", labelsize=TEXT)
    for ax in (top, bottom):
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(fc="0.3", label="S = Q Kᵀ, P V (tensor cores)"),
               Patch(fc="0.8", label="softmax (exp)"),
               Patch(fc="white", ec="0.3", hatch="///", label="store O"),
               Patch(fc="tab:red", label="waiting"),
               Patch(fc="0.8", ec="0.5", label="block start"),
               *[Patch(fc=ITEM_COLORS[k % len(ITEM_COLORS)], label=f"item {k}")
                 for k in range(len(tiles))]]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=TEXT,
               frameon=False)
    fig.suptitle(f"{len(tiles)} work items of {'/'.join(map(str, tiles))} K/V tiles on one SM: "
                 f"copy latency {latency:g}, K+V bytes {load:g}, a tile's math {mma:g} + softmax "
                 f"{softmax:g} per warpgroup", fontsize=TITLE)
    return fig


# ---------------------------------------------------------------- stage 12: O through the TMA

def _o_words(warp, d, half):
    """The 32 lanes of one warp's write of O in 12_tma_store.cu / 11_warpspec.cu: rows
    warp * 16 + g (+ 8 for half 1), columns 8 d + 2 t and + 1 (4 bytes a lane). Returns (rows,
    cols) of each lane's first element, rows counted in the consumer's 64."""
    lane = np.arange(WARP)
    g, t = lane // 4, lane % 4
    return warp * 16 + g + 8 * half, 8 * d + 2 * t


def o_store_requests(D=128) -> pd.DataFrame:
    """How one consumer warpgroup's 64 x D tile of O (16-bit) reaches global memory, both ways,
    counted from the kernels' own indexing.
    * stage 11 (`*reinterpret_cast<uint32_t*>(Ob + r * L.o.n + 8 * d + 2 * t) = ...`): each
      thread stores 4 bytes of rows r and r + 8, 8-column tile d by tile d, with st.global; one
      warp instruction writes 16 bytes in each of 8 rows;
    * stage 12: the same 4 bytes go to shared memory in the 128-byte swizzle (sw128), then one
      thread copies the tile out in D / 64 TMA boxes of 64 rows x 64 columns.
    Columns: warp instructions of the warpgroup; 32-byte sectors written to L2 (stage 11: counted
    per instruction, as each instruction sends its own); bytes of O per sector written; for the
    shared-memory stores, the wavefronts one instruction takes (flashlab.banks: 1 = no bank
    conflict); TMA boxes."""
    if D % 64:
        raise ValueError("D is a multiple of 64 (64 or 128 in the kernels)")
    instr = sectors11 = worst = 0
    for warp in range(4):
        for d in range(D // 8):
            for half in (0, 1):
                rows, cols = _o_words(warp, d, half)
                instr += 1  # one st.global in stage 11, one st.shared in stage 12
                sectors11 += sectors_per_request(rows * 2 * D + cols * 2).sectors  # row-major O
                words = sw128(2 * M, rows, cols) // BANK_BYTES  # a 128-row item, like BR
                worst = max(worst, wavefronts(words)[0])
    tile = M * D * 2
    return pd.DataFrame([
        dict(way="stage 11: st.global from registers", instructions=instr,
             sectors=sectors11, bytes_per_sector=tile / sectors11, smem_wavefronts=np.nan,
             tma_boxes=0),
        dict(way="stage 12: st.shared, then a TMA store", instructions=instr,
             sectors=tile // SECTOR, bytes_per_sector=float(SECTOR), smem_wavefronts=worst,
             tma_boxes=D // 64)]).set_index("way")


def o_store_figure(D=64, d=0):
    """One warp instruction of the end of a work item, both ways (warp 0, 8-column tile d, rows
    0-7). Left, stage 11: the rows of O in global memory, 4-byte words, lane numbers where this
    instruction writes; red boxes: the 32-byte sectors it touches, each half used. Right, stage
    12: the same lanes' words in shared memory, one 128-byte line (all 32 banks) per row, at the
    128-byte swizzle's places: every lane in a bank of its own, one wavefront."""
    fig = Figure(figsize=(15, 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    rows, cols = _o_words(0, d, 0)
    lanes = np.arange(WARP)
    words_per_row = 2 * D // BANK_BYTES
    # stage 11: global memory, row-major, D * 2 bytes a row
    grid = np.full((8, words_per_row), np.nan)
    col_word = cols * 2 // BANK_BYTES
    grid[rows, col_word] = lanes
    show = min(words_per_row, 32)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.94")
    left.imshow(np.ma.masked_invalid(grid[:, :show]), cmap=cmap, vmin=0, vmax=31, aspect="equal",
                interpolation="nearest")
    for lane, r, w in zip(lanes, rows, col_word):
        left.text(w, r, lane, ha="center", va="center", fontsize=9, color="white")
    per_sector = SECTOR // BANK_BYTES
    for r in range(8):
        for s in range(show // per_sector):
            hit = np.any((rows == r) & (col_word // per_sector == s))
            left.add_patch(Rectangle((s * per_sector - 0.5, r - 0.5), per_sector, 1, fill=False,
                                     ec="red" if hit else "0.6", lw=3 if hit else 0.8))
    req = o_store_requests(D)
    left.set_title(f"Stage 11: st.global of one warp (tile d = {d})\n8 rows x 16 bytes: 8 "
                   f"sectors of 32 bytes, each half written", fontsize=LABEL + 1)
    left.set_yticks(range(8), [f"row {r}" for r in range(8)], fontsize=TEXT)
    starts = np.arange(0, show, per_sector)
    left.set_xticks(starts, [f"+{w * BANK_BYTES}" for w in starts], fontsize=TEXT)
    shown = ", first 128 shown" if show < words_per_row else ""
    left.set_xlabel(f"byte in the row of O ({2 * D} bytes a row{shown})", fontsize=LABEL)
    # stage 12: shared memory, sw128
    smem = np.full((8, 32), np.nan)
    off = sw128(2 * M, rows, cols)
    bank = (off // BANK_BYTES) % BANKS
    smem[rows, bank] = lanes
    right.imshow(np.ma.masked_invalid(smem), cmap=cmap, vmin=0, vmax=31, aspect="equal",
                 interpolation="nearest")
    for lane, r, b in zip(lanes, rows, bank):
        right.text(b, r, lane, ha="center", va="center", fontsize=9, color="white")
    for r in range(8):
        for c in range(8):
            right.add_patch(Rectangle((4 * c - 0.5, r - 0.5), 4, 1, fill=False, ec="0.6",
                                      lw=0.8))
    waves = int(req.loc["stage 12: st.shared, then a TMA store", "smem_wavefronts"])
    right.set_title(f"Stage 12: st.shared of the same warp, 128-byte swizzle\nrow r's chunk "
                    f"{d % 8} at chunk {d % 8} ^ r: 32 lanes in 32 banks, {waves} wavefront",
                    fontsize=LABEL + 1)
    right.set_yticks(range(8), [f"row {r}" for r in range(8)], fontsize=TEXT)
    right.set_xticks(range(0, 32, 4), range(0, 32, 4), fontsize=TEXT)
    right.set_xlabel("bank (4 bytes each; grey boxes: 16-byte chunks)", fontsize=LABEL)
    s11 = req.iloc[0]
    fig.suptitle(f"The end of a work item, one warp instruction (D = {D}; number: lane)\nA "
                 f"consumer warpgroup's 64 x {D} tile of O takes {int(s11.instructions)} such "
                 f"instructions: {int(s11.sectors)} half-used sectors from registers, or "
                 f"{int(req.iloc[1].sectors)} full ones written by the TMA", fontsize=TITLE - 1)
    return fig


def store_gain(n_tiles=(4, 8, 16, 32, 64, 128), items=6, store11=1.2, store12=0.2,
               **times) -> pd.Series:
    """Stage 11's time over stage 12's per number of K/V tiles in a work item: warpspec_schedule
    (the same producer and consumers) with a consumer's end of item taking `store11` (its
    st.global, and the wait for them to drain before O's registers are reused) or `store12` (its
    st.shared, a named barrier and one TMA store; the copy itself runs under the next item).
    The other times are warpspec_schedule's keyword arguments."""
    def total(store):
        return lambda tiles: warpspec_schedule(tiles=tiles, stages=2, store=store, **times).total
    return _gain(n_tiles, items, "stage 11 time / stage 12 time", total(store11), total(store12))


# --- stage 13: the lazy rescale ------------------------------------------------------------------

LAZY_UNITS = 8  # a score may exceed the running maximum by this much (log2 units) in the lazy pass
LOG2E = 1.4426950408889634


def lazy_fallbacks(q, k, causal=False, BC=128, rows=16, units=LAZY_UNITS, scale=None) -> dict:
    """How often stage 13 takes a tile the classic way, for one head's q and k ((N, D) each, any
    dtype): after each 16-row group's (a warp's) first key tile, a tile whose scores exceed some
    row's running maximum m by more than `units` (log2 units, the scale folded in) is taken again
    the classic way, and m moves to the row's new maximum; otherwise m stays. Tiles a warp's rows
    never reach under the causal mask are not counted. Returns the count of lazy tiles, of
    classic fallbacks, their share, and the largest exponential a lazy tile wrote (<= 2^units)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    n, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    s = (q @ k.T) * scale * LOG2E
    if causal:
        s[np.triu_indices(n, 1)] = -np.inf
    tiles = -(-k.shape[0] // BC)
    lazy = fallbacks = 0
    top = 0.0
    for r0 in range(0, n, rows):
        block = s[r0:r0 + rows]
        last = min(n, r0 + rows) - 1
        mine = min(tiles, last // BC + 1) if causal else tiles
        m = block[:, :BC].max(axis=1)
        for j in range(1, mine):
            t = block[:, j * BC:(j + 1) * BC]
            tmax = t.max(axis=1)
            if np.any(tmax > m + units):
                fallbacks += 1
                m = np.maximum(m, tmax)
            else:
                lazy += 1
                with np.errstate(invalid="ignore"):
                    e = np.exp2(t - m[:, None])
                top = max(top, float(np.nanmax(e)) if np.isfinite(e).any() else 0.0)
    total = lazy + fallbacks
    return {"tiles after the first": total, "lazy": lazy, "classic": fallbacks,
            "classic share": fallbacks / total if total else 0.0, "largest lazy P": top}


def lazy_steps(D=128, BC=128) -> pd.DataFrame:
    """One consumer thread's softmax of a key tile, step by step, in instructions counted from the
    kernels' source (stage 12's softmax() + rescale + pack(), stage 13's fast()): a thread holds
    BC/2 scores of two row halves and D/2 accumulators of O. The last column says whether the step
    must wait for the tile's row maximum."""
    v = BC // 2
    rows = [
        ("row maximum (FMNMX)", v + 2, v, False),
        ("shuffles of the maximum (SHFL)", 4, 4, False),
        ("new maximum m, factor alpha (FMUL, MUFU)", 6, 0, False),
        ("exponent arguments s * scale - m (FFMA)", v, v, True),
        ("exponentials (MUFU.EX2)", v, v, True),
        ("row sums, l (FADD, FFMA)", v + 2, v + 2, True),
        ("pack P to 16 bits (F2FP)", v // 2, v // 2, True),
        ("rescale O by alpha (FMUL)", D // 2, 0, True),
        ("threshold test and vote (FADD, FSETP, VOTE)", 0, 5, False),
    ]
    df = pd.DataFrame(rows, columns=["step", "stage 12", "stage 13",
                                     "waits for the maximum in stage 12"]).set_index("step")
    df = df.astype({"waits for the maximum in stage 12": object})  # the total row leaves it blank
    df.loc["total"] = [df["stage 12"].sum(), df["stage 13"].sum(), ""]
    return df


def lazy_chain(D=128, BC=128, mufu=8, shuffle=30) -> dict:
    """A model of one warp alone doing one tile's softmax, in cycles: one instruction a cycle,
    an exponential every `mufu` cycles (the special-function unit: 4 lanes a cycle per SM
    sub-partition, 32 lanes a warp), a shuffle's result `shuffle` cycles after it issues. Other
    instructions issue in the gaps between exponentials. Stage 12 runs the maximum, its shuffles,
    the factor, then the exponentials, then the rescale of O; stage 13 runs the maximum and its
    shuffles beside the exponentials and ends with the test and the vote.
    Returns {stage: [(step, start, length)]}."""
    steps = lazy_steps(D, BC)["stage 12"]
    v = BC // 2
    exp_phase = max(v * mufu, 3 * v + v // 2 + 2)  # MUFU-paced; FFMA, FADD, F2FP fill the gaps
    s12, t = [], 0
    for name, length in (("row maximum", steps["row maximum (FMNMX)"]), ("shuffles", 2 * shuffle),
                         ("m, alpha", 2 * mufu), ("exponentials, sums, P", exp_phase),
                         ("rescale O", D // 2)):
        s12.append((name, t, int(length)))
        t += int(length)
    s13 = [("exponentials, sums, P", 0, exp_phase),
           ("row maximum, shuffles (beside)", 0, v + 2 * shuffle),
           ("test, vote", exp_phase, 5)]
    return {"stage 12": s12, "stage 13": s13}


def lazy_figure(D=128, BC=128, mufu=8, shuffle=30):
    """Stage 12's softmax of a tile against stage 13's lazy pass (lazy_chain's model of one warp
    alone): the exponentials no longer wait for the row maximum, and O is not rescaled."""
    chain = lazy_chain(D, BC, mufu=mufu, shuffle=shuffle)
    colors = {"row maximum": "#9ecae1", "shuffles": "#6baed6", "m, alpha": "#fdae6b",
              "exponentials, sums, P": "#74c476", "rescale O": "#fb6a4a",
              "row maximum, shuffles (beside)": "#9ecae1", "test, vote": "#756bb1"}
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax = fig.subplots()
    lanes = {"stage 12": 1.6, "stage 13": 0.0}
    ends = {}
    for stage, steps in chain.items():
        y = lanes[stage]
        for name, start, length in steps:
            beside = "beside" in name
            yy, h = (y - 0.45, 0.35) if beside else (y, 0.7)
            ax.add_patch(Rectangle((start, yy - h / 2), length, h, fc=colors[name], ec="0.2",
                                   lw=0.8))
            if length > 100:
                ax.text(start + length / 2, yy, name, ha="center", va="center", fontsize=TEXT)
            ends[stage] = max(ends.get(stage, 0), start + length)
        ax.text(ends[stage] + 8, y, f"{ends[stage]} cycles", va="center", fontsize=LABEL)
    ax.legend(handles=[Patch(fc=c, ec="0.2", label=n) for n, c in colors.items()
                       if "beside" not in n], loc="upper right", fontsize=TEXT, ncols=3,
              frameon=False)
    ax.set_yticks(list(lanes.values()), [f"stage {s[-2:]}" for s in lanes], fontsize=LABEL)
    ax.set_ylim(-0.9, 2.9)
    ax.set_xlim(0, max(ends.values()) * 1.12)
    ax.set_xlabel(f"cycles of one warp alone (a model: one instruction a cycle, an exponential "
                  f"every {mufu}, a shuffle's result after {shuffle})", fontsize=LABEL)
    ax.set_title(f"One consumer warp's softmax of a {BC}-key tile at D = {D}: the exponentials "
                 f"wait for the row maximum, or they do not", fontsize=TITLE - 1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig
