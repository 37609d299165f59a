"""Stage 09 on the CPU: wgmma's register layouts, its shared-memory matrix descriptor and the
128-byte swizzle, computed from the PTX ISA's rules and the kernel's own indexing (no GPU needed).

kernels/09_wgmma.cu multiplies with `wgmma.mma_async.sync.aligned.m64nNk16`, issued together by a
warpgroup (4 consecutive warps, 128 threads); its shared-memory operands are named by 64-bit
matrix descriptors (`wgmma_desc` in kernels/hopper.cuh) over tiles in the 128-byte swizzle
(`sw128`, the layout every later stage keeps: flashlab.tma_store writes O in it). Each function
below models a line of those files; tests/test_hopper.py keeps the lines each one follows and
checks that they are still there (and compiles hopper.cuh's own encoders on the host to compare
them with the ones here).

    from flashlab import wgmma
    wgmma.accumulator_figure(64)                  # who holds which element of the accumulator
    wgmma.encode_descriptor(0x10400, 16, 1024)    # a descriptor, as hopper.cuh's wgmma_desc
    wgmma.swizzle_figure(D=128)                   # stage 06's XOR against the 128-byte swizzle
    wgmma.ring_figure()                           # the K/V buffers, iteration by iteration

Notation (the PTX ISA's): thread t of a warpgroup is in warp w = t // 32, lane l = t % 32;
groupID g = l // 4 and threadID_in_group q = l % 4, as in flashlab.fragments.
"""
from typing import NamedTuple

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .banks import BANK_BYTES, BANKS, wavefronts
from .fragments import LANES
from .hopper_common import LABEL, M, ROW_BYTES, TEXT, TITLE, WARP, WARPGROUP

ATOM_ROWS = 8     # rows of one 128-byte swizzle atom (1024 bytes)
CHUNK = 16        # bytes of one swizzled chunk: 8 16-bit elements

WARP_COLORS = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb")   # pale: warps 0..3 of a warpgroup
PICKED = ("#08306b", "#a50f15", "#00441b", "#3f007d")        # dark: the threads called out


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


# ---------------------------------------------------------------- the ring of K/V buffers

RING_LOAD = "#9ecae1"    # a tile's cp.async copies in flight
RING_MATH = "#3182bd"    # S = Q Kᵀ, the softmax and P·V's issue: the tile's iteration
RING_TAIL = 0.35         # how much of the next iteration a P·V left running is drawn to hold


def ring_steps(n_tiles=6, stages=3, retire=False) -> pd.DataFrame:
    """What each K/V buffer of 09_wgmma.cu holds, in iterations of its K/V loop (iteration j runs
    from j, its barrier, to j + 1; -1 to 0 is the start, where Q is copied). Tile t lives in buffer
    t % stages. The first stages - 1 tiles are copied with Q; tile t after them is issued at
    iteration t - AHEAD (`const int next = j + AHEAD;` in arrive_and_load), with
    AHEAD = stages - 2, or stages - 1 with RETIRE, and has landed by the barrier of iteration t.
    Iteration t reads tile t (S = Q Kᵀ, then P·V). Without RETIRE the P·V of tile t runs on into
    iteration t + 1, until the wait for S of tile t + 1 retires it (drawn as the first RING_TAIL
    of that iteration); with RETIRE it retires before the barrier of iteration t + 1.
    Returns a row per (tile, what): tile, buffer, what ("load", "S, P·V", "P·V runs on"), start,
    end, and ahead (AHEAD)."""
    ahead = stages - 1 if retire else stages - 2
    if ahead < 1:
        raise ValueError("the kernel needs stages >= 3, or stages >= 2 with retire")
    if n_tiles < 1:
        raise ValueError("n_tiles is at least 1")
    rows = []
    for t in range(n_tiles):
        buf = t % stages
        issued = -1 if t < stages - 1 else t - ahead
        rows.append(dict(tile=t, buffer=buf, what="load", start=issued, end=t))
        rows.append(dict(tile=t, buffer=buf, what="S, P·V", start=t, end=t + 1))
        if not retire:
            rows.append(dict(tile=t, buffer=buf, what="P·V runs on", start=t + 1,
                             end=t + 1 + RING_TAIL))
    df = pd.DataFrame(rows)
    df["ahead"] = ahead
    return df


def ring_figure(n_tiles=6, rings=((3, False), (2, True))):
    """ring_steps on a time axis, one panel per (stages, retire) in `rings`: a lane per buffer, a
    column per iteration of the K/V loop. Light: a tile's copies in flight (issued after a
    barrier, landed by the barrier of the iteration that reads it); dark: the iteration that
    reads the tile; hatched: its P·V still running while the next iteration starts. Dashed
    lines: each iteration's barrier (cp.async wait, fence.proxy.async, __syncthreads)."""
    fig = Figure(figsize=(15, 0.9 + sum(1.0 + 0.75 * s for s, _ in rings)), layout="constrained")
    axes = fig.subplots(len(rings), 1, squeeze=False,
                        gridspec_kw=dict(height_ratios=[s + 1.2 for s, _ in rings]))[:, 0]
    for ax, (stages, retire) in zip(axes, rings):
        df = ring_steps(n_tiles, stages, retire)
        ahead = int(df["ahead"].iloc[0])
        h = 0.7
        for r in df.itertuples():
            y = r.buffer
            if r.what == "load":
                ax.broken_barh([(r.start, r.end - r.start)], (y - h / 2, h), fc=RING_LOAD,
                               ec="0.3", lw=0.8)
                where = "copied with Q" if r.start < 0 else "load"
                ax.text((r.start + r.end) / 2, y, f"{where}: tile {r.tile}", ha="center",
                        va="center", fontsize=TEXT, bbox=dict(fc=RING_LOAD, ec="none", pad=0.5))
            elif r.what == "S, P·V":
                ax.broken_barh([(r.start, r.end - r.start)], (y - h / 2, h), fc=RING_MATH,
                               ec="0.3", lw=0.8)
                ax.text((r.start + r.end) / 2, y, f"S, P·V: tile {r.tile}", ha="center",
                        va="center", fontsize=TEXT, color="white", fontweight="bold")
            else:
                ax.broken_barh([(r.start, r.end - r.start)], (y - h / 2, h), fc="white",
                               ec=RING_MATH, lw=0.8, hatch="///")
        for j in range(n_tiles):
            ax.axvline(j, color="0.35", ls="--", lw=0.9)
        ax.set_yticks(range(stages), [f"buffer {b}" for b in range(stages)], fontsize=LABEL)
        ax.set_ylim(stages - 0.5, -0.5)
        ax.set_xticks([-0.5] + [j + 0.5 for j in range(n_tiles)],
                      ["start"] + [f"iteration {j}" for j in range(n_tiles)], fontsize=TEXT)
        ax.set_xlim(-1.02, n_tiles + (0 if retire else RING_TAIL) + 0.02)
        ax.tick_params(axis="x", length=0)
        how = ("each P·V retired before the next barrier" if retire
               else "each P·V left running into the next iteration")
        ax.set_title(f"{stages} buffers, {how}: loads run {ahead} tile{'s' if ahead > 1 else ''}"
                     f" ahead", fontsize=LABEL + 1, loc="left")
        for s in ("top", "right"):
            ax.spines[s].set_visible(False)
    handles = [Patch(fc=RING_LOAD, ec="0.3", label="copies in flight (cp.async)"),
               Patch(fc=RING_MATH, ec="0.3", label="the iteration that reads the tile"),
               Patch(fc="white", ec=RING_MATH, hatch="///", label="its P·V still running"),
               matplotlib.lines.Line2D([], [], color="0.35", ls="--",
                                       label="barrier: wait, fence.proxy.async, __syncthreads")]
    axes[-1].legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4,
                    fontsize=TEXT, frameon=False)
    fig.suptitle("Stage 09's ring of K/V buffers: tile t lives in buffer t % STAGES, and a buffer "
                 "is refilled only once no product reads it", fontsize=TITLE - 1)
    return fig
