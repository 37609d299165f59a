"""Stage 05's tensor-core register layouts, computed from the PTX ISA's rules (no GPU needed).

kernels/05_mma.cu multiplies with `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` and loads
its operands with `ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16`. Both are warp-wide: the 32
lanes hold a matrix between them, a few registers each, in a layout the ISA fixes. The rules are
written out once below, as the PTX ISA states them ("Warp Level Matrix Multiply-Accumulate
Instructions" > "Matrix Fragments for mma.m16n8k16 with floating point type", anchor
#warp-level-matrix-fragment-mma-16816-float; and "ldmatrix", #warp-level-matrix-instructions-
ldmatrix), and everything else is derived from them: the figures, the quad reduction of the
softmax, why P never goes through shared memory, and a numpy emulation of one warp's tile.

Notation (the ISA's): lane l, groupID g = l >> 2 (0..7), threadID_in_group t = l % 4 (0..3); the
4 lanes sharing g are a quad. Elements are numbered per lane as in the ISA: a0..a7 and b0..b3 are
halves, two to a 32-bit register (a0, a1 in register 0, ...); c0..c3 are floats, one a register.
A fragment is held here as a (32, elements) array: row l is lane l's registers, low half first.
"""
import math
from typing import NamedTuple

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .banks import BANK_BYTES, BANKS, WAVEFRONT_BYTES, wavefronts

WARP = 32
LANES = ListedColormap([matplotlib.colormaps["tab20"](i) for i in range(20)]
                       + [matplotlib.colormaps["tab20b"](i) for i in range(12)], name="lanes")

# ---------------------------------------------------------------- the ISA's rules


def _a(lane, i):
    """A (M x K = 16 x 16, .row), a0..a7: row g for a0, a1, a4, a5, else g + 8;
    col 2t + (i & 1), + 8 for i >= 4."""
    g, t = lane >> 2, lane % 4
    return (g if i < 2 or 4 <= i < 6 else g + 8), t * 2 + (i & 1) + (8 if i >= 4 else 0)


def _b(lane, i):
    """B (K x N = 16 x 8, .col), b0..b3: row 2t + (i & 1), + 8 for i >= 2; col g."""
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def _c(lane, i):
    """C and D (M x N = 16 x 8, .f32), c0..c3: row g for c0, c1, g + 8 for c2, c3;
    col 2t + (i & 1)."""
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


# kind: (rule, matrix shape, elements per lane, elements per 32-bit register)
FRAGMENTS = {"A": (_a, (16, 16), 8, 2), "B": (_b, (16, 8), 4, 2), "C": (_c, (16, 8), 4, 1)}


def coords(kind):
    """(rows, cols), each (32, elements): where element i of lane l sits in the matrix."""
    rule, _, n, _ = FRAGMENTS[kind]
    rc = np.array([[rule(lane, i) for i in range(n)] for lane in range(WARP)])
    return rc[..., 0], rc[..., 1]


class Layout(NamedTuple):
    """One array per question, each the matrix's shape: for every (row, col) element..."""
    lane: np.ndarray  # ...the lane holding it,
    elem: np.ndarray  # its number in that lane (a_i, b_i, c_i),
    reg: np.ndarray   # the 32-bit register it is in (elem // 2 for f16x2, elem for f32).


def layout(kind) -> Layout:
    """The fragment layout of "A", "B" or "C" as the ISA's figures draw it: inverts the rule,
    checking on the way that the 32 lanes cover every element exactly once."""
    _, shape, n, per_reg = FRAGMENTS[kind]
    rows, cols = coords(kind)
    count = np.zeros(shape, int)
    np.add.at(count, (rows, cols), 1)
    assert (count == 1).all(), f"{kind}: an element held by {count.min()} or {count.max()} lanes"
    lane, elem = np.empty(shape, int), np.empty(shape, int)
    lane[rows, cols] = np.arange(WARP)[:, None]
    elem[rows, cols] = np.arange(n)[None, :]
    return Layout(lane, elem, elem // per_reg)


def to_fragment(matrix, kind):
    """Scatter a 16 x 16 (A) or 16 x 8 (B, C) matrix into the lanes: (32, elements)."""
    return np.asarray(matrix)[coords(kind)]


def from_fragment(frag, kind):
    """Gather the lanes' registers (32, elements) back into the matrix."""
    out = np.empty(FRAGMENTS[kind][1], np.asarray(frag).dtype)
    out[coords(kind)] = frag
    return out


def ldmatrix_address_lanes(num=4):
    """(matrix, row) whose shared-memory address each lane supplies, (-1, -1) where unused.
    ISA table: threads 0-7 give addr0-addr7 (the rows of matrix 0), 8-15 the rows of matrix 1,
    ...; .x1 reads lanes 0-7 only, .x2 lanes 0-15 (sm_75 still wants the others valid)."""
    lane = np.arange(WARP)
    used = lane < 8 * num
    return np.where(used, lane // 8, -1), np.where(used, lane % 8, -1)


def ldmatrix_layout(trans=False):
    """(lane, half), each 8 x 8: where element (r, c) of a stored 8x8 matrix lands (r: its
    16-byte row in shared memory). ISA: "a group of four threads loads an entire row", lane l
    getting row l >> 2, elements 2(l % 4) and 2(l % 4) + 1 -- the layout of one register of an
    A fragment. .trans loads it column-major: element (r, c) goes where (c, r) would."""
    r, c = np.indices((8, 8))
    if trans:
        r, c = c, r
    return 4 * r + c // 2, c % 2


def ldmatrix(smem, rows, cols, num=4, trans=False):
    """One warp's ldmatrix.m8n8.x{num}(.trans).b16 on a 2-D shared-memory tile of 16-bit
    elements: lane l's address points at smem[rows[l], cols[l]], the start of an 8-element row
    of matrix l // 8. Returns (32, 2 * num): register m of every lane holds its part of matrix m."""
    out = np.empty((WARP, num, 2), smem.dtype)
    lane, half = ldmatrix_layout(trans)
    for m in range(num):
        starts = zip(rows[8 * m:8 * m + 8], cols[8 * m:8 * m + 8])
        out[lane, m, half] = np.stack([smem[r, c:c + 8] for r, c in starts])
    return out.reshape(WARP, 2 * num)


# Where the 4 matrices of an ldmatrix.x4 sit, in 8 x 8 blocks (down, right), for matrix m (lanes
# 8m..8m+7): "down" a 16 x 16 block, down then across; "across" the same block, across then down;
# "row" an 8 x 32 strip, the 4 matrices side by side.
X4_MODES = {"down": lambda m: (m % 2, m // 2), "across": lambda m: (m // 2, m % 2),
            "row": lambda m: (0, m)}


def x4_addresses(row0=0, col0=0, mode="down"):
    """(rows, cols): where each lane points ldmatrix.x4 to, the start of one 8-element row of
    matrix lane // 8 (row lane % 8 of it), for matrices laid out from (row0, col0) as X4_MODES
    says. "down" [top-left, bottom-left, top-right, bottom-right] of a 16 x 16 block gives
    registers a0..a3 of an A fragment, and, with .trans on V[key][d], the B fragments of d
    columns col0.. and col0 + 8... "across" [top-left, top-right, bottom-left, bottom-right] of
    K[key][d] gives the B fragments of keys row0.. and row0 + 8... "row" reads 8 keys x 32 dims
    of K[key][d]: the B fragments of those keys for two k-steps, dims col0.. and col0 + 16..
    (stage 05 reads K this way: k_addresses)."""
    if mode not in X4_MODES:
        raise ValueError(f"mode is one of {', '.join(X4_MODES)}, not {mode!r}")
    lane = np.arange(WARP)
    down, right = X4_MODES[mode](lane // 8)
    return row0 + 8 * down + lane % 8, col0 + 8 * right


# Stage 05's three ldmatrix.x4 calls, with the kernel's own loop variables: kernels/05_mma.cu
# passes smem_u32(tile + row * LD + col) with the (row, col) below, and warp_tile uses these and
# nothing else (tests/test_fragments.py evaluates the kernel's expressions against them):
#   Q   Qw + (lane % 16) * LD + kk * 16 + (lane / 16) * 8          A of k-step kk
#   K   Ks + (n * 8 + lane % 8) * LD + kk * 16 + (lane / 8) * 8    B of keys 8n.., k-steps kk, kk+1
#   V   Vs + (ks * 16 + lane % 16) * LD + d * 8 + (lane / 16) * 8  .trans: B of k-step ks, n8
#                                                                  tiles d, d + 1 of O
def q_addresses(kk):
    return x4_addresses(0, 16 * kk)


def k_addresses(n, kk):
    return x4_addresses(8 * n, 16 * kk, mode="row")


def v_addresses(ks, d):
    return x4_addresses(16 * ks, 8 * d)


KERNEL_LDMATRIX = {"Q": (q_addresses, False), "K": (k_addresses, False), "V": (v_addresses, True)}


# ---------------------------------------------------------------- the warp's arithmetic


def mma(a, b, c):
    """One mma.m16n8k16.row.col.f32.f16.f16.f32 on fragments a (32, 8), b (32, 4), c (32, 4):
    the tensor core sees whole matrices, reassembled from the lanes, multiplied in fp32; D comes
    back in C's layout."""
    A = from_fragment(a, "A").astype(np.float32)
    B = from_fragment(b, "B").astype(np.float32)
    return to_fragment(A @ B + from_fragment(c, "C"), "C")


def shfl_xor(x, mask):
    """__shfl_xor_sync(0xffffffff, x, mask): every lane gets lane (l ^ mask)'s value."""
    return np.asarray(x)[np.arange(WARP) ^ mask]


def quad_reduce(x, op=np.maximum):
    """Row max (or sum, op=np.add) of C fragments: a row lives in one quad (lanes 4g..4g+3),
    so two butterfly steps, xor 1 then xor 2, give all four lanes the whole row's result."""
    x = op(x, shfl_xor(x, 1))
    return op(x, shfl_xor(x, 2))


def repack(c_lo, c_hi, half=np.float16):
    """P's A fragment for keys 16kk..16kk+15 from S's C fragments of keys 16kk.. (c_lo) and
    16kk + 8.. (c_hi): a_i = c_(i % 4) of tile i // 4, so the PV mma's operand is the QK^T mma's
    accumulator, converted pairwise to f16x2 (cvt.rn.f16x2.f32) in the same lane: no shuffle,
    no shared memory. repack_map() derives it from the layouts."""
    return np.concatenate([c_lo, c_hi], axis=1).astype(half)


def repack_map() -> pd.DataFrame:
    """For every element of a 16 x 16 block of P: the lane and a_i holding it as the PV mma's
    A operand, and the n8 tile, lane and c_j holding it as an accumulator of the QK^T mma.
    Asserts that the lane is always the same and that a_i = c_(i % 4) of tile i // 4."""
    A, C = layout("A"), layout("C")
    row, col = np.indices((16, 16))
    df = pd.DataFrame(dict(row=row.ravel(), col=col.ravel(), a_lane=A.lane.ravel(),
                           a_reg=A.reg.ravel(), a_elem=A.elem.ravel(), tile=col.ravel() // 8,
                           c_lane=np.hstack([C.lane, C.lane]).ravel(),
                           c_elem=np.hstack([C.elem, C.elem]).ravel()))
    assert (df.a_lane == df.c_lane).all(), "P would have to move between lanes"
    assert (df.a_elem == 4 * df.tile + df.c_elem).all()
    return df.sort_values(["a_lane", "a_elem"], ignore_index=True)


class Tile(NamedTuple):
    o: np.ndarray  # (16, D): softmax(q k^T * scale) v over this tile
    m: np.ndarray  # (16,): row max of the scaled scores
    l: np.ndarray  # (16,): row sum of exp(s - m)


def warp_tile(q, k, v, scale=None, half=np.float16) -> Tile:
    """One warp's 16 query rows against one K/V tile, in registers, as stage 05 does it: the
    kernel's loops, loop variables and ldmatrix addresses (KERNEL_LDMATRIX).
    q (16, D), k and v (BC, D) as shared memory holds them ([row][d]); `half` is the operands'
    16-bit type (np.float32 keeps everything exact, to test the layouts alone). m comes from
    this tile alone, as for the first tile of a row."""
    q, k, v = (np.asarray(x).astype(half) for x in (q, k, v))
    D, BC = q.shape[1], k.shape[0]
    KD, NS, KS, NO = D // 16, BC // 8, BC // 16, D // 8  # the kernel's constants
    scale = 1 / math.sqrt(D) if scale is None else scale
    # Q: one A fragment per k-step, loaded once (qf[kk]: 4 registers of 2 halves, (32, 8))
    qf = [ldmatrix(q, *q_addresses(kk)) for kk in range(KD)]
    # S = Q K^T: one C fragment per n8 tile of keys; an ldmatrix.x4 of K feeds two k-steps
    s = np.zeros((NS, WARP, 4), np.float32)
    for n in range(NS):
        for kk in range(0, KD, 2):
            b = ldmatrix(k, *k_addresses(n, kk))                # b[0], b[1] | b[2], b[3]
            s[n] = mma(qf[kk], b[:, :4], s[n])
            s[n] = mma(qf[kk + 1], b[:, 4:], s[n])
    s *= scale
    # softmax: a lane holds rows g (c0, c1) and g + 8 (c2, c3) of every tile; its quad the rest
    m = quad_reduce(np.stack([s[..., :2].max((0, 2)), s[..., 2:].max((0, 2))], 1))   # (32, 2)
    p = np.exp(s - np.repeat(m, 2, axis=1))
    l = quad_reduce(np.stack([p[..., :2].sum((0, 2)), p[..., 2:].sum((0, 2))], 1), np.add)
    # O = P V: P's accumulators are already A fragments; V's B fragments come via .trans
    o = np.zeros((NO, WARP, 4), np.float32)
    for ks in range(KS):
        a = repack(p[2 * ks], p[2 * ks + 1], half)
        for d in range(0, NO, 2):
            b = ldmatrix(v, *v_addresses(ks, d), trans=True)   # n8 tiles d | d + 1 of O
            o[d] = mma(a, b[:, :4], o[d])
            o[d + 1] = mma(a, b[:, 4:], o[d + 1])
    o /= np.repeat(l, 2, axis=1)
    out = np.hstack([from_fragment(o[d], "C") for d in range(NO)])
    quad0 = slice(0, WARP, 4)  # lane 4g holds rows g and g + 8
    return Tile(out, np.concatenate([m[quad0, 0], m[quad0, 1]]),
                np.concatenate([l[quad0, 0], l[quad0, 1]]))


# ---------------------------------------------------------------- shared-memory banks


def smem_offset(row, col, row_bytes, swizzle=False):
    """Byte offset of 16-bit element (row, col) in a tile with rows row_bytes apart; swizzle
    stores 16-byte chunk c of row r at chunk c ^ (r % 8) (rows a multiple of 128 bytes)."""
    if swizzle and row_bytes % 128:
        raise ValueError("the XOR swizzle permutes 8 chunks: rows must be 128 x n bytes")
    chunk = (2 * np.asarray(col)) // 16
    if swizzle:
        chunk = chunk ^ (np.asarray(row) % 8)
    return np.asarray(row) * row_bytes + 16 * chunk + (2 * np.asarray(col)) % 16


class LdmatrixCost(NamedTuple):
    wavefronts: int  # shared-memory passes of one ldmatrix.x4
    ideal: int       # 4: one 128-byte pass per 8x8 matrix
    ways: int        # the worst phase's conflict degree (1 = conflict-free)


def ldmatrix_wavefronts(row_bytes, swizzle=False, mode="down") -> LdmatrixCost:
    """Cost of one ldmatrix.x4 (matrices placed as x4_addresses' `mode` says), rows row_bytes
    apart, modelled as the hardware serves it: 4 phases, one 8x8 matrix each, 8 lanes reading a
    16-byte row -- 128 bytes, one wavefront if the 8 rows fall in different banks
    (flashlab.banks counts them). Unpadded D = 64 fp16 rows (128 bytes) all start in bank 0:
    8-way; + 16 bytes: 1."""
    addr = smem_offset(*x4_addresses(mode=mode), row_bytes, swizzle) // BANK_BYTES
    per = [wavefronts(addr[8 * m:8 * m + 8], vector=16 // BANK_BYTES)[0] for m in range(4)]
    return LdmatrixCost(sum(per), 4, max(per))


def _warp_wavefronts(rows, cols, row_bytes, swizzle, vector):
    """Wavefronts of one warp's shared-memory access: lane l at element (rows[l], cols[l]),
    `vector` 4-byte words each."""
    return wavefronts(smem_offset(rows, cols, row_bytes, swizzle) // BANK_BYTES, vector)[0]


def _copy_wavefronts(rows, D, row_bytes, swizzle, threads):
    """The 16-byte shared-memory stores of stage 05's load_tile (`rows` x D): element e =
    threadIdx.x + i * THREADS goes to row e / CHUNKS, column (e % CHUNKS) * 8. Whole block."""
    chunks, lane = D // 8, np.arange(WARP)
    return sum(_warp_wavefronts(e // chunks, e % chunks * 8, row_bytes, swizzle, 4)
               for first in range(0, rows * chunks, WARP) for e in [first + lane])


class TileCost(NamedTuple):
    """What one block of stage 05 asks of an SM per K/V tile (ldmatrix counts and wavefronts
    from the kernel's own addresses and flashlab.banks)."""
    flops: int                # tensor-core FLOPs, 4 BR BC D
    mma: int                  # mma.sync per warp: NS KD for S, KS NO for O
    ldmatrix: int             # ldmatrix.x4 per warp, K and V
    ldmatrix_wavefronts: int  # of all warps' ldmatrix
    store_wavefronts: int     # the K and V tiles' 16-byte stores into shared memory
    global_bytes: int         # K and V tiles read from global memory (L2, or DRAM)

    @property
    def wavefronts(self):
        return self.ldmatrix_wavefronts + self.store_wavefronts


def tile_cost(D=64, BR=64, BC=64, pad_bytes=16, swizzle=False) -> TileCost:
    """Stage 05's cost per K/V tile per block, 16-bit inputs, rows D * 2 + pad_bytes apart
    (0 and swizzle=True: stage 06's layout)."""
    warps, row_bytes = BR // 16, 2 * D + pad_bytes
    KD, NS, KS, NO = D // 16, BC // 8, BC // 16, D // 8
    k_x4, v_x4 = NS * KD // 2, KS * NO // 2
    per_warp = (k_x4 * ldmatrix_wavefronts(row_bytes, swizzle, "row").wavefronts
                + v_x4 * ldmatrix_wavefronts(row_bytes, swizzle, "down").wavefronts)
    return TileCost(4 * BR * BC * D, NS * KD + KS * NO, k_x4 + v_x4, warps * per_warp,
                    2 * _copy_wavefronts(BC, D, row_bytes, swizzle, 32 * warps), 2 * BC * D * 2)


def block_once_wavefronts(D=64, BR=64, pad_bytes=16, swizzle=False) -> int:
    """Shared-memory wavefronts a block of stage 05 spends outside its K/V loop: Q stored and
    read by ldmatrix once; O's fragments stored 4 bytes a lane (row g, column d * 8 + 2t) and
    read back 16 bytes a lane for the global stores."""
    warps, row_bytes, lane = BR // 16, 2 * D + pad_bytes, np.arange(WARP)
    g, t, chunks = lane // 4, lane % 4, D // 8
    q = _copy_wavefronts(BR, D, row_bytes, swizzle, 32 * warps) \
        + warps * D // 16 * ldmatrix_wavefronts(row_bytes, swizzle).wavefronts
    o_stores = sum(_warp_wavefronts(g + 8 * h, 8 * d + 2 * t, row_bytes, swizzle, 1)
                   for d in range(D // 8) for h in (0, 1))
    o_reads = sum(_warp_wavefronts(e // chunks, e % chunks * 8, row_bytes, swizzle, 4)
                  for first in range(0, 16 * chunks, WARP) for e in [first + lane])
    return q + warps * (o_stores + o_reads)


def launch_wavefronts(B, H, N, D=64, BR=64, BC=64, pad_bytes=16, swizzle=False) -> int:
    """Shared-memory wavefronts of a whole non-causal launch of stage 05: what Nsight Compute's
    smem_wavefronts should count (the model's prediction of it)."""
    blocks, tiles = B * H * math.ceil(N / BR), math.ceil(N / BC)
    return blocks * (tiles * tile_cost(D, BR, BC, pad_bytes, swizzle).wavefronts
                     + block_once_wavefronts(D, BR, pad_bytes, swizzle))


# ---------------------------------------------------------------- figures


def _cells(ax, lanes, labels, title, xlabel, ylabel, block=8, cmap=LANES, size=5.5):
    """A grid of matrix cells coloured by lane, labelled, with lines around the 8x8 blocks."""
    ax.imshow(lanes, cmap=cmap, vmin=0, vmax=cmap.N - 1, interpolation="nearest")
    for (r, c), text in np.ndenumerate(labels):
        ax.text(c, r, text, ha="center", va="center", fontsize=size)
    for x in range(block, lanes.shape[1], block):
        ax.axvline(x - 0.5, color="k", lw=1.5)
    for y in range(block, lanes.shape[0], block):
        ax.axhline(y - 0.5, color="k", lw=1.5)
    ax.set_xticks(range(lanes.shape[1]))
    ax.set_yticks(range(lanes.shape[0]))
    ax.tick_params(labelsize=7, length=0)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)


def fragment_figure(kind="A"):
    """The matrix of an mma.m16n8k16 operand, each element labelled with the lane (T) that holds
    it and its element name, coloured by lane: the ISA's figures, redrawn from its rules."""
    L = layout(kind)
    name = {"A": "a", "B": "b", "C": "c"}[kind]
    labels = np.vectorize(lambda ln, e: f"T{ln}\n{name}{e}")(L.lane, L.elem)
    rows, cols = L.lane.shape
    what = {"A": ("A: 16 x 16 f16, .row (M x K)", "k", "m"),
            "B": ("B: 16 x 8 f16, .col (K x N)", "n", "k"),
            "C": ("C, D: 16 x 8 f32 (M x N)", "n", "m")}[kind]
    per = "two halves per register (register = i // 2)" if kind != "C" else "one per register"
    fig = Figure(figsize=(0.55 * cols + 1, 0.48 * rows + 1), layout="constrained")
    _cells(fig.subplots(), L.lane, labels,
           f"mma.m16n8k16 {what[0]}\nlane l = 4g + t holds {name}0..{name}"
           f"{FRAGMENTS[kind][2] - 1}, {per}", *what[1:])
    return fig


def ldmatrix_figure(trans=False):
    """ldmatrix.x4 of a 16 x 16 shared-memory tile. Left: its four 8x8 matrices and the lane
    whose address starts each row. Right: where each element lands: lane T, register r."""
    rows, cols = x4_addresses()
    r, c = np.indices((16, 16))
    mat = r // 8 + 2 * (c // 8)
    lane = ldmatrix_layout(trans)[0][r % 8, c % 8]
    fig = Figure(figsize=(14, 7.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    addr = np.full((16, 16), "", dtype=object)
    for ln, (rr, cc) in enumerate(zip(rows, cols)):
        addr[rr, cc] = f"T{ln}→"
    _cells(left, mat, addr, "shared memory: matrices 0..3; lanes 8m..8m+7 give matrix m's row "
           "addresses", "column (16-bit elements)", "row",
           cmap=ListedColormap(["#dbe9f6", "#fde0c5", "#d5f0d5", "#eadcf2"]), size=8)
    op = "trans: a quad takes a column" if trans else "a quad takes a row"
    _cells(right, lane, np.vectorize(lambda ln, m: f"T{ln}\nr{m}")(lane, mat),
           f"registers: lane T, register r = matrix ({op})", "column", "row")
    fig.suptitle(f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16"
                 + ("" if trans else ": exactly the A fragment a0..a7"), fontsize=11)
    return fig


def quad_figure(BC=64, g=1):
    """Left: a warp's 16 x BC score tile; the quad of groupID g (lanes 4g..4g+3, coloured by t)
    holds all of rows g and g + 8, two columns per n8 tile each. Right: the butterfly that gives
    every lane of the quad the whole row's max (or sum): xor 1, then xor 2."""
    t = np.full((16, BC), np.nan)
    t[[g, g + 8], :] = (np.arange(BC) % 8) // 2
    fig = Figure(figsize=(14, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[BC / 16 + 1, 3])
    cmap = ListedColormap([LANES(4 * g + i) for i in range(4)]).with_extremes(bad="0.93")
    left.imshow(np.ma.masked_invalid(t), cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto")
    for x in range(8, BC, 8):
        left.axvline(x - 0.5, color="k", lw=1)
    left.set_title(f"S tile 16 x {BC} (lines: n8 tiles): lanes {4 * g}..{4 * g + 3} hold rows "
                   f"{g} and {g + 8}, 2 keys of each tile per lane", fontsize=9)
    left.set_xlabel("key")
    left.set_ylabel("query row")
    seen = [{i} for i in range(4)]  # the t whose keys each lane's value covers
    for s, mask in enumerate((0, 1, 2)):
        seen = [seen[i] | seen[i ^ mask] for i in range(4)]
        for i, who in enumerate(seen):
            right.text(s, i, f"T{4 * g + i}: t = {','.join(map(str, sorted(who)))}", ha="center",
                       va="center", fontsize=8, bbox=dict(fc=LANES(4 * g + i), ec="none"))
            if mask:  # the value it receives from lane l ^ mask
                right.plot([s - 0.62, s - 0.38], [i ^ mask, i], color="0.4", lw=0.8)
    right.set_xticks(range(3), ["own columns", "shfl_xor 1", "shfl_xor 2"])
    right.set_yticks([])
    right.set_xlim(-0.5, 2.5)
    right.set_ylim(3.5, -0.5)
    right.set_title("which lanes (t) each lane's running max covers", fontsize=9)
    fig.suptitle("A row of S lives in one quad: its max and sum take 2 __shfl_xor_sync steps",
                 fontsize=11)
    return fig


def bank_map(row_bytes, swizzle=False, ax=None):
    """The 16-byte chunks of 8 rows of a shared-memory tile, each labelled with the first of the
    4 banks it lands in (colour: bank // 4); red: the 8 rows one ldmatrix phase reads (column 0
    of the block). Grey: padding. Draws into `ax` if given."""
    n = row_bytes // 16
    data = n - (row_bytes % 128) // 16
    r, c = np.indices((8, n))
    bank = np.where(c < data, smem_offset(r, 8 * c, row_bytes, swizzle) // BANK_BYTES % BANKS, -1)
    if ax is None:
        ax = Figure(figsize=(0.75 * n + 1.5, 4), layout="constrained").subplots()
    cmap = matplotlib.colormaps["tab10"].resampled(8).with_extremes(bad="0.85")
    ax.imshow(np.ma.masked_less(bank // 4, 0), cmap=cmap, vmin=-0.5, vmax=7.5)
    for (rr, cc), b in np.ndenumerate(bank):
        ax.text(cc, rr, f"{b}" if b >= 0 else "pad", ha="center", va="center", fontsize=8)
    ax.add_patch(Rectangle((-0.5, -0.5), 1, 8, fill=False, ec="red", lw=2.5))
    cost = ldmatrix_wavefronts(row_bytes, swizzle)
    ax.set_title(f"rows of {row_bytes} bytes{', XOR swizzle' if swizzle else ''}: first bank of "
                 f"each 16-byte chunk\nldmatrix.x4: {cost.wavefronts} wavefronts (ideal "
                 f"{cost.ideal}), {cost.ways}-way", fontsize=9)
    ax.set_xlabel("16-byte chunk of the row (8 halves)")
    ax.set_ylabel("row")
    return ax.figure


# ---------------------------------------------------------------- stage 06: three layouts, side by side

# How stages 05-07 place a tile's rows in shared memory: keyword arguments of the functions below
# (and of tile_cost). Dense rows are what stage 05 would have had without its padding.
LAYOUTS = {"dense rows": dict(pad_bytes=0, swizzle=False),
           "+16 bytes a row (05)": dict(pad_bytes=16, swizzle=False),
           "XOR swizzle (06)": dict(pad_bytes=0, swizzle=True)}


def smem_bytes(D, BR=64, BC=64, pad_bytes=16, stages=1) -> int:
    """Shared memory per block of stages 05-07 (their Tiles::SMEM_BYTES): Q's BR rows and
    `stages` buffers of K and V, BC rows each, every row 2 D + pad_bytes bytes. Stage 05: pad 16;
    06: pad 0; 07: pad 0, stages 2."""
    return (BR + 2 * BC * stages) * (2 * D + pad_bytes)


# One warp's shared-memory requests in stages 05-07, as the kernels index them at loop index 0
# (tests/test_fragments.py checks that the other indices cost the same): description, and
# (rows, cols, 4-byte words per lane, lanes served together) for a head dim D. ldmatrix.x4 is
# served one 8 x 8 matrix, 8 lanes, at a time; the other requests a warp at once.
ACCESSES = {
    "ldmatrix K": "ldmatrix.x4 of K: 8 keys x 32 dims (S = Q Kᵀ)",
    "ldmatrix Q, V": "ldmatrix.x4 of Q, or .trans of V: 16 rows x 16 dims",
    "tile rows": "16-byte stores that fill a Q/K/V tile (and the reads of O's rows on the way "
                 "out)",
    "O stores": "4-byte stores of O's accumulators before the write-out",
}


def warp_access(access, D=64):
    """(rows, cols, words, phase) of ACCESSES[access]: lane l touches `words` 4-byte words from
    element (rows[l], cols[l]) of the tile; groups of `phase` lanes are served one after the
    other. "tile rows": lane e stores chunk e of the tile, row-major (load_tile's
    e = threadIdx.x + i * THREADS, row e / CHUNKS, column (e % CHUNKS) * 8); "O stores": lane
    (g, t) writes row g, columns 2t, 2t + 1 of O's first 8-column tile."""
    lane = np.arange(WARP)
    chunks = D // 8
    table = {"ldmatrix K": (*k_addresses(0, 0), 4, 8),
             "ldmatrix Q, V": (*x4_addresses(), 4, 8),
             "tile rows": (lane // chunks, lane % chunks * 8, 4, WARP),
             "O stores": (lane // 4, 2 * (lane % 4), 1, WARP)}
    if access not in table:
        raise ValueError(f"access is one of {', '.join(table)}, not {access!r}")
    return table[access]


class AccessCost(NamedTuple):
    wavefronts: int       # shared-memory passes the warp's request takes
    ideal: int            # its bytes / 128: the fewest possible
    passes: np.ndarray    # (32,): the pass that serves each lane
    banks: np.ndarray     # (32, words): the banks each lane touches


def access_cost(access, D=64, pad_bytes=0, swizzle=False, shift=(0, 0)) -> AccessCost:
    """warp_access through the bank model (flashlab.banks), rows 2 D + pad_bytes bytes apart,
    every lane moved by shift = (rows, cols) (another loop index)."""
    rows, cols, words, phase = warp_access(access, D)
    addr = smem_offset(rows + shift[0], cols + shift[1], 2 * D + pad_bytes, swizzle) // BANK_BYTES
    passes, total = np.empty(WARP, int), 0
    for first in range(0, WARP, phase):
        n, p = wavefronts(addr[first:first + phase], words)
        passes[first:first + phase] = p + total
        total += n
    banks = (addr[:, None] + np.arange(words)) % BANKS
    return AccessCost(total, max(1, WARP * words * BANK_BYTES // WAVEFRONT_BYTES), passes, banks)


def access_table(D=64) -> pd.DataFrame:
    """Wavefronts of every ACCESSES request in every LAYOUTS layout, with the ideal: the
    conflicts each layout leaves, counted from the kernels' addresses."""
    rows = {ACCESSES[a]: {name: access_cost(a, D, **how).wavefronts for name, how in LAYOUTS.items()}
            | {"ideal": access_cost(a, D).ideal} for a in ACCESSES}
    return pd.DataFrame(rows).T.rename_axis(f"one warp's request, D = {D}")


def bank_maps(D=64):
    """bank_map of the three LAYOUTS side by side, for rows of D halves."""
    fig = Figure(figsize=(15 if D <= 64 else 20, 4.3), layout="constrained")
    for ax, (name, how) in zip(fig.subplots(1, 3), LAYOUTS.items()):
        bank_map(2 * D + how["pad_bytes"], how["swizzle"], ax=ax)
        ax.set_title(f"{name}\n{ax.get_title()}", fontsize=9)
    fig.suptitle(f"Rows of {D} halves in three layouts: where each logical 16-byte chunk of the "
                 "first 8 rows lands (label: its first bank)", fontsize=10)
    return fig


def bank_comparison(access="ldmatrix K", D=64):
    """Which banks each lane of a warp's request touches (rows: lanes, columns: the 32 banks;
    thin lines: 16-byte bank groups), in each of the three LAYOUTS side by side. A cell's number
    and colour are the wavefront (pass) that serves that lane: two lanes in one column of a
    phase (between thick lines) with different numbers are a bank conflict."""
    words, phase = warp_access(access, D)[2:]
    fig = Figure(figsize=(15, 6.2), layout="constrained")
    axes = fig.subplots(1, 3, sharey=True)
    cmap = matplotlib.colormaps["tab20"].with_extremes(bad="white")
    for ax, (name, how) in zip(axes, LAYOUTS.items()):
        cost = access_cost(access, D, **how)
        grid = np.full((WARP, BANKS), np.nan)
        grid[np.arange(WARP)[:, None], cost.banks] = cost.passes[:, None]
        ax.imshow(np.ma.masked_invalid(grid % 20), cmap=cmap, vmin=0, vmax=19, aspect="auto",
                  interpolation="nearest")
        for lane, (first, served) in enumerate(zip(cost.banks[:, 0], cost.passes)):
            ax.text(first + (words - 1) / 2, lane, served, ha="center", va="center", fontsize=6)
        for x in range(4, BANKS, 4):
            ax.axvline(x - 0.5, color="0.8", lw=0.6)
        for y in range(phase, WARP, phase):
            ax.axhline(y - 0.5, color="k", lw=1.2)
        ax.set_xticks(range(0, BANKS, 4))
        ax.set_yticks(range(0, WARP, 4))
        ax.set_xlabel("bank")
        slower = f"{cost.wavefronts / cost.ideal:.0f}x the ideal" if cost.wavefronts > cost.ideal \
            else "conflict-free"
        ax.set_title(f"{name}: {cost.wavefronts} wavefronts (ideal {cost.ideal}), {slower}",
                     fontsize=9)
    axes[0].set_ylabel("lane" + (f" (thick lines: the {WARP // phase} phases)" if phase < WARP
                                 else ""))
    fig.suptitle(f"{ACCESSES[access]}, D = {D}: the banks each lane touches, numbered by the "
                 "wavefront that serves it", fontsize=10)
    return fig
