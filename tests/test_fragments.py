"""flashlab.fragments: the PTX ISA's m16n8k16 and ldmatrix layouts, the P re-pack, the warp
emulation against plain numpy, the ldmatrix bank model; every figure draws."""
import inspect
import io
import itertools
import re

import matplotlib
import numpy as np
import pytest
from matplotlib.figure import Figure

from flashlab import fragments as fr
from flashlab.paths import KERNELS

matplotlib.use("Agg")
LANES = np.arange(32)


@pytest.mark.parametrize("kind, n", [("A", 8), ("B", 4), ("C", 4)])
def test_every_element_held_once(kind, n):
    L = fr.layout(kind)
    pairs = sorted(zip(L.lane.ravel().tolist(), L.elem.ravel().tolist()))
    assert pairs == [(lane, i) for lane in range(32) for i in range(n)]
    m = np.arange(L.lane.size).reshape(L.lane.shape)
    assert (fr.from_fragment(fr.to_fragment(m, kind), kind) == m).all()


def _held(kind, lane):
    """{(row, col): element} of what `lane` holds."""
    L = fr.layout(kind)
    return {tuple(rc): int(L.elem[tuple(rc)]) for rc in np.argwhere(L.lane == lane)}


def test_ptx_spot_checks():
    assert _held("A", 0) == {(0, 0): 0, (0, 1): 1, (8, 0): 2, (8, 1): 3,
                             (0, 8): 4, (0, 9): 5, (8, 8): 6, (8, 9): 7}
    assert _held("C", 5) == {(1, 2): 0, (1, 3): 1, (9, 2): 2, (9, 3): 3}
    assert _held("B", 5) == {(2, 1): 0, (3, 1): 1, (10, 1): 2, (11, 1): 3}
    A = fr.layout("A")
    assert A.lane[15, 15] == 31 and A.reg[15, 15] == 3 and A.elem[15, 15] == 7
    assert (fr.layout("C").reg == fr.layout("C").elem).all()


def test_quad_holds_whole_rows():
    C = fr.layout("C")
    assert (C.lane // 4 == np.arange(16)[:, None] % 8).all()   # row r: lanes of quad r % 8
    x = LANES.astype(float)
    q = fr.quad_reduce(x)
    assert (q == LANES // 4 * 4 + 3).all()
    assert (fr.quad_reduce(x, np.add) == 16 * (LANES // 4) + 6).all()


def test_ldmatrix_addresses():
    m, r = fr.ldmatrix_address_lanes(4)
    assert (m == LANES // 8).all() and (r == LANES % 8).all()
    m, r = fr.ldmatrix_address_lanes(1)
    assert (m[:8] == 0).all() and (m[8:] == -1).all()
    assert (fr.ldmatrix_address_lanes(2)[0][16:] == -1).all()


def test_ldmatrix_layouts():
    lane, half = fr.ldmatrix_layout()
    assert lane[0].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and half[0].tolist() == [0, 1] * 4
    lt, ht = fr.ldmatrix_layout(trans=True)
    assert (lt == lane.T).all() and (ht == half.T).all()
    rng = np.random.default_rng(1)
    tile = rng.standard_normal((32, 40))
    # plain x4, matrices down then across: the A fragment of the 16 x 16 block at (16, 8)
    a = fr.ldmatrix(tile, *fr.x4_addresses(16, 8))
    assert (a == fr.to_fragment(tile[16:32, 8:24], "A")).all()
    # K[key][d], across: the B fragments of keys 0..7 and 8..15 (B = K^T)
    b = fr.ldmatrix(tile, *fr.x4_addresses(0, 16, mode="across"))
    assert (b[:, :4] == fr.to_fragment(tile[0:8, 16:32].T, "B")).all()
    assert (b[:, 4:] == fr.to_fragment(tile[8:16, 16:32].T, "B")).all()
    # K[key][d], a row of 4 matrices (stage 05): keys 8..15, dims 0..15 and 16..31
    b = fr.ldmatrix(tile, *fr.x4_addresses(8, 0, mode="row"))
    assert (b[:, :4] == fr.to_fragment(tile[8:16, 0:16].T, "B")).all()
    assert (b[:, 4:] == fr.to_fragment(tile[8:16, 16:32].T, "B")).all()
    with pytest.raises(ValueError):
        fr.x4_addresses(mode="diagonal")
    # V[key][d] with .trans: the B fragments of d columns 8..15 and 16..23 (B = V)
    bv = fr.ldmatrix(tile, *fr.x4_addresses(16, 8), trans=True)
    assert (bv[:, :4] == fr.to_fragment(tile[16:32, 8:16], "B")).all()
    assert (bv[:, 4:] == fr.to_fragment(tile[16:32, 16:24], "B")).all()
    # .x1: register 0 only, from lanes 0-7's addresses
    x1 = fr.ldmatrix(tile, *fr.x4_addresses(0, 0), num=1)
    assert x1.shape == (32, 2) and (x1 == fr.to_fragment(tile[:16, :16], "A")[:, :2]).all()


def test_mma_is_a_matmul():
    rng = np.random.default_rng(2)
    A, B, C = (rng.standard_normal(shape) for shape in ((16, 16), (16, 8), (16, 8)))
    d = fr.mma(fr.to_fragment(A, "A"), fr.to_fragment(B, "B"), fr.to_fragment(C, "C"))
    assert np.allclose(fr.from_fragment(d, "C"), A @ B + C, rtol=1e-5, atol=1e-5)


def test_repack_identity():
    df = fr.repack_map()
    assert len(df) == 256 and (df.a_lane == df.c_lane).all()
    assert (df.a_elem == 4 * df.tile + df.c_elem).all()
    assert (df.a_reg == df.a_elem // 2).all()
    p = np.random.default_rng(3).standard_normal((16, 16)).astype(np.float32)
    a = fr.repack(fr.to_fragment(p[:, :8], "C"), fr.to_fragment(p[:, 8:], "C"), np.float32)
    assert (a == fr.to_fragment(p, "A")).all()


def _attention(q, k, v):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[1])
    m = s.max(1)
    p = np.exp(s - m[:, None])
    return p @ v / p.sum(1)[:, None], m, p.sum(1)


@pytest.mark.parametrize("D", [64, 128])
def test_warp_tile_matches_numpy(D, BC=64):
    rng = np.random.default_rng(D)
    q, k, v = (rng.standard_normal((rows, D)) for rows in (16, BC, BC))
    o, m, l = _attention(q, k, v)
    t = fr.warp_tile(q, k, v, half=np.float32)   # 32-bit operands: the layouts alone
    assert np.allclose(t.o, o, rtol=1e-5, atol=1e-5)
    assert np.allclose(t.m, m, rtol=1e-5, atol=1e-5) and np.allclose(t.l, l, rtol=1e-5)
    h = [x.astype(np.float16) for x in (q, k, v)]
    o16 = fr.warp_tile(*h).o                     # fp16 operands, P rounded to fp16 too
    assert np.abs(o16 - _attention(*h)[0]).max() < 2e-3


def _ldmatrix_calls(source):
    """[(function, tile pointer, address expression)] of every ldmatrix in a kernel's source:
    the text inside smem_u32(...), parentheses balanced."""
    calls = []
    for m in re.finditer(r"\b(ldmatrix_x4(?:_trans)?)\(\w+(?:\[[^]]*\])?,\s*smem_u32\(", source):
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        base, expr = source[m.end():i - 1].split("+", 1)
        calls.append((m.group(1), base.strip(), " ".join(expr.split())))
    return calls


def test_the_emulation_quotes_the_kernel(monkeypatch):
    """kernels/05_mma.cu's three ldmatrix addresses, evaluated for lanes 0..31 at every value of
    their loop variables, are the ones warp_tile loads with (fragments.KERNEL_LDMATRIX)."""
    calls = _ldmatrix_calls((KERNELS / "05_mma.cu").read_text())
    assert {base[0] for _, base, _ in calls} == set(fr.KERNEL_LDMATRIX) and len(calls) == 3
    LD = 1 << 20  # any stride longer than a row: the offset splits into (row, column)
    for func, base, expr in calls:
        addresses, trans = fr.KERNEL_LDMATRIX[base[0]]
        assert func.endswith("_trans") == trans, f"{base}: {func}"
        loop = sorted(set(re.findall(r"[A-Za-z_]\w*", expr)) - {"lane", "LD"})
        assert loop == sorted(inspect.signature(addresses).parameters), (base, expr)
        python = expr.replace("/", "//")
        for values in itertools.product(range(4), repeat=len(loop)):
            env = dict(zip(loop, values))
            off = eval(python, {}, dict(env, lane=np.arange(32), LD=LD))
            rows, cols = addresses(**env)
            assert (off // LD == rows).all() and (off % LD == cols).all(), (base, expr, env)
    # ...and warp_tile loads through them, as often as the kernel does per K/V tile
    count = dict.fromkeys(fr.KERNEL_LDMATRIX, 0)
    for op, (addresses, _) in fr.KERNEL_LDMATRIX.items():
        def spy(*args, op=op, addresses=addresses):
            count[op] += 1
            return addresses(*args)
        monkeypatch.setattr(fr, addresses.__name__, spy)
    D, BC = 64, 64
    rng = np.random.default_rng(5)
    fr.warp_tile(*(rng.standard_normal((r, D)) for r in (16, BC, BC)))
    assert count == {"Q": D // 16, "K": BC // 8 * D // 32, "V": BC // 16 * D // 16}


@pytest.mark.parametrize("row_bytes, swizzle, ways", [
    (128, False, 8), (64 * 2 + 16, False, 1), (128, True, 1),
    (256, False, 8), (128 * 2 + 16, False, 1), (256, True, 1)])
def test_ldmatrix_wavefronts(row_bytes, swizzle, ways):
    cost = fr.ldmatrix_wavefronts(row_bytes, swizzle)
    assert cost.ways == ways and cost.ideal == 4 and cost.wavefronts == 4 * ways


def test_swizzle_is_a_permutation_of_each_row():
    r, c = np.indices((8, 64))
    off = fr.smem_offset(r, c, 128, swizzle=True)
    assert (np.sort(off, axis=1) == fr.smem_offset(r, c, 128)).all()
    with pytest.raises(ValueError):
        fr.smem_offset(0, 0, 144, swizzle=True)


@pytest.mark.parametrize("draw", [
    lambda: fr.fragment_figure("A"), lambda: fr.fragment_figure("B"),
    lambda: fr.fragment_figure("C"), fr.ldmatrix_figure, lambda: fr.ldmatrix_figure(True),
    fr.quad_figure, lambda: fr.bank_map(128), lambda: fr.bank_map(144),
    lambda: fr.bank_map(128, swizzle=True)])
def test_figures_render(draw):
    fig = draw()
    assert isinstance(fig, Figure)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.tell() > 1000


def test_bank_map_titles_carry_the_counts():
    assert "8-way" in fr.bank_map(128).axes[0].get_title()
    assert "1-way" in fr.bank_map(128, swizzle=True).axes[0].get_title()


@pytest.mark.parametrize("D", [64, 128])
def test_tile_cost(D, BR=64, BC=64):
    padded = fr.tile_cost(D)
    assert padded.flops == 4 * BR * BC * D == BR // 16 * padded.mma * 2 * 16 * 8 * 16
    assert padded.ldmatrix == BC // 8 * D // 32 + BC // 16 * D // 16
    # conflict-free: 4 wavefronts an ldmatrix.x4, 128 bytes a wavefront for the K, V copies
    assert padded.ldmatrix_wavefronts == BR // 16 * padded.ldmatrix * 4
    assert padded.store_wavefronts == padded.global_bytes // 128 == 2 * BC * D * 2 // 128
    unpadded = fr.tile_cost(D, pad_bytes=0)
    assert unpadded.ldmatrix_wavefronts == 8 * padded.ldmatrix_wavefronts
    assert unpadded.store_wavefronts == padded.store_wavefronts   # a row per 8 lanes: no conflict
    assert fr.tile_cost(D, pad_bytes=0, swizzle=True) == padded
    # once per block: Q in (64 + 64 at D = 64), O out (2 x 16 + 16 per warp at D = 64)
    assert fr.block_once_wavefronts(D) == D // 64 * 256
    blocks, tiles = 4 * 16 * 1024 // BR, 1024 // BC
    assert fr.launch_wavefronts(4, 16, 1024, D) == blocks * (tiles * padded.wavefronts + D // 64 * 256)


# ---------------------------------------------------------------- stages 06 and 07: the swizzle

SWIZZLED = ["06_swizzle", "07_cp_async"]


@pytest.mark.parametrize("slug, how", [("05_mma", dict(pad_bytes=16)),
                                       ("06_swizzle", dict(pad_bytes=0)),
                                       ("07_cp_async", dict(pad_bytes=0, stages=2))])
def test_smem_bytes_is_the_kernels_formula(slug, how):
    text = (KERNELS / f"{slug}.cu").read_text()
    formula = re.search(r"SMEM_BYTES = ([^;]+);", text).group(1)
    for D in (64, 128):
        env = dict(D=D, BR=64, BC=64, LD=D + 8, STAGES=how.get("stages", 1))
        assert eval(formula, {}, env) == fr.smem_bytes(D, **how), (slug, formula, D)


@pytest.mark.parametrize("slug", SWIZZLED)
def test_swz_is_smem_offset(slug):
    """The kernel's swz<D>(row, col), in halves, is smem_offset(..., swizzle=True) in bytes / 2."""
    body = re.search(r"int swz\(int row, int col\) \{\s*return ([^;]+);", (KERNELS / f"{slug}.cu")
                     .read_text()).group(1)
    row, col = np.indices((64, 16))
    for D in (64, 128):
        col8 = col * 8 % D
        assert (eval(body, {}, dict(row=row, col=col8, D=D))
                == fr.smem_offset(row, col8, 2 * D, swizzle=True) // 2).all()


def _split_args(text):
    """'a(b, c), d' -> ['a(b, c)', 'd']: top-level commas only."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + [cur.strip()]


@pytest.mark.parametrize("slug", SWIZZLED)
def test_swizzled_stages_read_what_05_reads(slug):
    """Stages 06 and 07 call ldmatrix with swz<D>(row, col) where stage 05 had row * LD + col:
    the same (row, col) for every lane and loop index, only the layout differs."""
    calls = _ldmatrix_calls((KERNELS / f"{slug}.cu").read_text())
    assert len(calls) == 3
    for func, base, expr in calls:
        op = {"Qw": "Q", "Ks": "K", "Kt": "K", "Vs": "V", "Vt": "V"}[base]
        addresses, trans = fr.KERNEL_LDMATRIX[op]
        assert func.endswith("_trans") == trans
        inner = re.fullmatch(r"swz<D>\((.*)\)", expr).group(1)
        row, col = (a.replace("/", "//") for a in _split_args(inner))
        loop = sorted(inspect.signature(addresses).parameters)
        for values in itertools.product(range(4), repeat=len(loop)):
            env = dict(zip(loop, values), lane=LANES)
            rows, cols = addresses(**dict(zip(loop, values)))
            assert (eval(row, {}, env) == rows).all() and (eval(col, {}, env) == cols).all()


@pytest.mark.parametrize("D", [64, 128])
def test_access_table(D):
    t = fr.access_table(D)
    padded, swizzled = t["+16 bytes a row (05)"], t["XOR swizzle (06)"]
    assert (padded == t["ideal"]).all() and (swizzled == t["ideal"]).all()
    dense = t["dense rows"] / t["ideal"]
    assert dense.tolist() == [8, 8, 1, 8]   # ldmatrix K, ldmatrix Q/V, tile rows, O stores


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["+16 bytes a row (05)", "XOR swizzle (06)"])
def test_access_costs_do_not_depend_on_the_loop_index(D, layout):
    """access_cost is taken at loop index 0; every other index of the kernels' loops (and warp,
    and load_tile trip) costs the same."""
    how = fr.LAYOUTS[layout]
    shifts = {"ldmatrix K": [(8 * n, 16 * kk) for n in range(8) for kk in range(0, D // 16, 2)],
              "ldmatrix Q, V": [(16 * ks, 8 * d) for ks in range(4) for d in range(0, D // 8, 2)],
              "tile rows": [(32 * i // (D // 8), 0) for i in range(64 * D // 8 // 32)],
              "O stores": [(8 * h + 16 * w, 8 * d) for h in (0, 1) for w in range(4)
                           for d in range(D // 8)]}
    for access, moves in shifts.items():
        base = fr.access_cost(access, D, **how).wavefronts
        assert {fr.access_cost(access, D, shift=s, **how).wavefronts for s in moves} == {base}


@pytest.mark.parametrize("draw", [fr.bank_maps, lambda: fr.bank_maps(128),
                                  *[lambda a=a: fr.bank_comparison(a) for a in fr.ACCESSES],
                                  lambda: fr.bank_comparison("O stores", 128)])
def test_layout_figures_render(draw):
    fig = draw()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    assert buf.tell() > 1000


def test_bank_comparison_titles_carry_the_counts():
    titles = [ax.get_title() for ax in fr.bank_comparison("ldmatrix K").axes]
    assert "32 wavefronts" in titles[0] and "8x the ideal" in titles[0]
    assert all("4 wavefronts (ideal 4), conflict-free" in t for t in titles[1:])
    with pytest.raises(ValueError):
        fr.warp_access("ldmatrix P")
