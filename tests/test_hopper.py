"""The Hopper stages' lesson modules on the CPU (flashlab.wgmma, .tma, .warpspec, .tma_store,
.lazy_rescale): wgmma's register layouts against stage 05's mma.sync layouts, the matrix
descriptor and the 128-byte swizzle against hopper.cuh's own encoders (compiled on the host with
nvcc), the bank model, the mbarrier ring's invariants, stage 11's models (register budgets, work
claiming, the producer/consumer schedule) and stage 13's lazy rescale; every figure draws."""
import io
import itertools
import random
import subprocess

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from flashlab import build
from flashlab import fragments as fr
from flashlab import lazy_rescale, tma, tma_store, warpspec, wgmma
from flashlab.paths import KERNELS


# ---------------------------------------------------------------- who holds what

@pytest.mark.parametrize("N", [64, 128, 192])
def test_accumulator_covers_every_element_once(N):
    df = wgmma.accumulator_owner(N)
    assert len(df) == 64 * N
    assert not df.duplicated(["row", "col"]).any()
    assert set(zip(df.row, df.col)) == set(itertools.product(range(64), range(N)))
    per_thread = df.groupby("thread")["reg"].agg(["count", "min", "max", "nunique"])
    assert len(per_thread) == 128
    assert (per_thread["count"] == N // 2).all() and (per_thread["nunique"] == N // 2).all()
    assert (per_thread["min"] == 0).all() and (per_thread["max"] == N // 2 - 1).all()
    assert (df.thread == 32 * df.warp + df.lane).all()
    assert (df.row // 16 == df.warp).all()                      # a warp owns 16 rows


def test_accumulator_spot_checks():
    df = wgmma.accumulator_owner(64).set_index(["thread", "reg"])
    at = lambda t, i: tuple(df.loc[(t, i), ["row", "col"]])   # noqa: E731
    assert [at(0, i) for i in range(4)] == [(0, 0), (0, 1), (8, 0), (8, 1)]
    assert at(0, 4) == (0, 8) and at(0, 31) == (8, 57)
    assert at(5, 0) == (1, 2) and at(5, 3) == (9, 3)            # lane 5: g = 1, q = 1
    assert at(37, 0) == (17, 2)                                 # warp 1, lane 5
    assert at(127, 31) == (63, 63)


@pytest.mark.parametrize("N", [64, 128])
def test_each_warp_repeats_the_mma_c_fragment(N):
    """Warp w's 16 rows, 8-column tile j: stage 05's m16n8 C layout, c_r in d[4j + r]."""
    C = fr.layout("C")
    df = wgmma.accumulator_owner(N)
    for w in range(4):
        for j in range(N // 8):
            part = df[(df.warp == w) & (df.col // 8 == j)]
            lane = np.empty((16, 8), int)
            reg = np.empty((16, 8), int)
            lane[part.row - 16 * w, part.col - 8 * j] = part.lane
            reg[part.row - 16 * w, part.col - 8 * j] = part.reg
            assert (lane == C.lane).all()
            assert (reg == 4 * j + C.elem).all()


def test_a_fragment_is_the_mma_a_layout_per_warp():
    A = fr.layout("A")
    df = wgmma.a_fragment_owner()
    assert len(df) == 64 * 16 and not df.duplicated(["row", "col"]).any()
    assert (df.groupby("thread").size() == 8).all()             # 4 registers of 2 halves
    for w in range(4):
        part = df[df.warp == w]
        assert set(part.row) == set(range(16 * w, 16 * w + 16))
        lane, elem = np.empty((16, 16), int), np.empty((16, 16), int)
        lane[part.row - 16 * w, part.col] = part.lane
        elem[part.row - 16 * w, part.col] = 2 * part.reg + part.half
        assert (lane == A.lane).all() and (elem == A.elem).all()
    t0 = df[df.thread == 0].set_index(["reg", "half"])
    assert tuple(t0.loc[(1, 0), ["row", "col"]]) == (8, 0)      # a1 = (g + 8, 2q)
    assert tuple(t0.loc[(2, 1), ["row", "col"]]) == (0, 9)      # a2 = (g, 2q + 8 ..)


@pytest.mark.parametrize("BC", [64, 128])
def test_p_is_already_an_a_fragment(BC):
    df = wgmma.p_repack(BC)                                     # asserts the mapping itself
    assert len(df) == 64 * BC


# ---------------------------------------------------------------- the descriptor

def test_descriptor_fields_match_the_ptx_isa():
    spans = {f.name: (f.lo, f.hi, f.shift) for f in wgmma.DESCRIPTOR_FIELDS}
    assert spans == {"start_address": (0, 13, 4), "leading_byte_offset": (16, 29, 4),
                     "stride_byte_offset": (32, 45, 4), "base_offset": (49, 51, 0),
                     "swizzle": (62, 63, 0)}
    bits = [b for f in wgmma.DESCRIPTOR_FIELDS for b in range(f.lo, f.hi + 1)]
    assert len(bits) == len(set(bits)) and max(bits) == 63     # no overlaps, within 64 bits
    assert wgmma.SWIZZLE_MODES[1] == "128-byte"


def test_descriptor_round_trip():
    rng = random.Random(0)
    for _ in range(200):
        kw = dict(start_address=16 * rng.randrange(1 << 14),
                  leading_byte_offset=16 * rng.randrange(1 << 14),
                  stride_byte_offset=16 * rng.randrange(1 << 14), base_offset=rng.randrange(8),
                  swizzle=rng.randrange(4))
        desc = wgmma.encode_descriptor(kw["start_address"], kw["leading_byte_offset"],
                                    kw["stride_byte_offset"], kw["swizzle"], kw["base_offset"])
        assert 0 <= desc < 1 << 64
        assert wgmma.decode_descriptor(desc) == kw
    one = wgmma.encode_descriptor(0x10, 0x10, 0x10, swizzle=3, base_offset=7)
    assert one == 1 | 1 << 16 | 1 << 32 | 7 << 49 | 3 << 62


def test_descriptor_rejects_what_it_cannot_hold():
    with pytest.raises(ValueError):
        wgmma.encode_descriptor(8, 16, 1024)                    # not in 16-byte units
    with pytest.raises(ValueError):
        wgmma.encode_descriptor(1 << 18, 16, 1024)              # past 14 bits of 16 bytes
    with pytest.raises(ValueError):
        wgmma.encode_descriptor(0, 16, 1024, swizzle=4)
    with pytest.raises(ValueError):
        wgmma.decode_descriptor(1 << 14)                        # a reserved bit


def test_kernel_descriptors():
    df = wgmma.kernel_descriptors(D=128, BC=128, WGS=2, STAGES=3)
    q = df[df.operand.str.startswith("Q")].set_index("step").start
    k = df[df.operand.str.startswith("K")].set_index("step").start
    assert list(q[:4]) == [0, 32, 64, 96]                       # 32 bytes per k-step ...
    assert q[4] == 128 * 128 and k[4] - k[0] == 128 * 128       # ... next 64-column block
    v = df[df.operand.str.startswith("V")]
    assert (v.lead == 128 * 128).all() and (v.stride == 1024).all()
    assert list(np.diff(v.start)) == [2048] * 7                 # 16 keys a k-step
    assert len(wgmma.kernel_descriptors(D=64, BC=64, STAGES=4)) == 2 * 4 + 4


# ---------------------------------------------------------------- the 128-byte swizzle

def test_sw128_is_stage06_at_d64():
    row, col = np.meshgrid(np.arange(256), np.arange(64), indexing="ij")
    for rows in (64, 128, 256):
        assert (wgmma.sw128(rows, row, col) == wgmma.swz06(64, row, col)).all()


@pytest.mark.parametrize("D, rows", [(64, 64), (128, 64), (128, 128), (256, 8)])
def test_sw128_is_a_permutation_and_the_hardware_pattern(D, rows):
    row, col = np.meshgrid(np.arange(rows), np.arange(D), indexing="ij")
    off = wgmma.sw128(rows, row, col)
    assert sorted(off.ravel() // 2) == list(range(rows * D))   # every element once, no gaps
    plain = (col // 64) * rows * 128 + row * 128 + (col % 64) * 2
    assert (off == wgmma.swizzle128_address(plain)).all()      # address bits 4-6 ^= bits 7-9


def test_stage06_at_d128_is_not_the_hardware_pattern():
    row, col = np.meshgrid(np.arange(8), np.arange(128), indexing="ij")
    off = wgmma.swz06(128, row, col)
    assert sorted(off.ravel() // 2) == list(range(8 * 128))
    assert (off != wgmma.swizzle128_address(2 * (row * 128 + col))).any()
    # the same chunk permutation within each half-row, but 256-byte rows instead of two blocks
    assert ((off % 256) // 16 % 8 == (wgmma.sw128(8, row, col) % 128) // 16).all()


@pytest.mark.parametrize("D", [64, 128])
def test_swizzle_banks_are_conflict_free(D):
    df = wgmma.swizzle_banks(D)
    assert set(df.layout) == {"stage 06", "wgmma 128B"} and len(df) == 2 * D // 8
    assert (df.distinct_banks == 32).all() and (df.wavefronts == 1).all()
    firsts = df[[f"r{k}" for k in range(8)]].to_numpy()
    assert (np.sort(firsts, axis=1) == np.arange(0, 32, 4)).all()  # 8 rows x 4 banks = 32
    assert (wgmma.swizzle_banks(D, first_row=5).distinct_banks == 32).all()


# ---------------------------------------------------------------- hopper.cuh itself, on the host

HOST_PROGRAM = r"""
#include <cstdio>
#include "hopper.cuh"
int main() {
  const unsigned d[][3] = {%DESC%};
  for (const auto& x : d)
    std::printf("desc %u %u %u %llu\n", x[0], x[1], x[2],
                (unsigned long long)wgmma_desc(x[0], x[1], x[2]));
  const int s[][3] = {%SW%};
  for (const auto& x : s)
    std::printf("sw128 %d %d %d %u\n", x[0], x[1], x[2], sw128(x[0], x[1], x[2]));
  return 0;
}
"""


def test_kernel_encoders_match(tmp_path):
    nvcc = build.nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    descs = [(0, 16, 1024), (0x400, 16, 1024), (0x10000, 16, 1024), (0x12340, 16, 1024),
             (0x2A7E0, 128 * 128, 1024), (0x3FFF0, 64 * 128, 1024), (0x18020, 16, 1024)]
    descs += [(r["start"], r["lead"], r["stride"]) for _, r in
              wgmma.kernel_descriptors(smem=0x10400).iloc[::5].iterrows()]
    sws = [(64, 0, 0), (64, 3, 77), (128, 127, 127), (64, 9, 8), (128, 5, 70), (8, 7, 63),
           (192, 100, 65), (128, 0, 64)]
    text = (HOST_PROGRAM.replace("%DESC%", ", ".join("{%d, %d, %d}" % t for t in descs))
            .replace("%SW%", ", ".join("{%d, %d, %d}" % t for t in sws)))
    src = tmp_path / "encoders.cu"
    src.write_text(text)
    exe = tmp_path / "encoders"
    done = subprocess.run([nvcc, "-std=c++17", f"-I{KERNELS}", str(src), "-o", str(exe)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = [ln.split() for ln in out.splitlines() if ln]
    assert len(got) == len(descs) + len(sws)
    for kind, *vals in got:
        a, b, c, out = map(int, vals)
        if kind == "desc":
            assert out == wgmma.encode_descriptor(a, b, c), (a, b, c)
            assert wgmma.decode_descriptor(out)["start_address"] == a
        else:
            assert out == wgmma.sw128(a, b, c), (a, b, c)


# Lines of the kernels each model of stages 09-13 follows: (file in kernels/, the text as it is there).
SOURCE = {
    "accumulator": ("hopper.cuh", "lane l of warp w holds\n// rows 16w + l/4 and 16w + l/4 + 8"),
    "a_fragment": ("hopper.cuh", "A (64 x 16) in registers (4 b16x2 per thread, the mma.sync A "
                                 "layout in each\n// warp's 16 rows)"),
    "p_repack": ("09_wgmma.cu", "p[ks][0] = pack2<T>(s[8 * ks], s[8 * ks + 1]);"),
    "descriptor": ("hopper.cuh", "return (uint64_t)((smem_addr & 0x3FFFF) >> 4) | "
                                 "(uint64_t)((lead_bytes & 0x3FFFF) >> 4) << 16 |"),
    "sw128": ("hopper.cuh", "return (uint32_t)((col / 64) * rows * 128 + row * 128 + "
                            "((((col % 64) / 8) ^ (row % 8)) * 16) +"),
    "swz06": ("06_swizzle.cu", "return row * D + (((col >> 3) ^ (row & 7)) << 3);"),
    "q_desc": ("09_wgmma.cu", "const uint64_t a = wgmma_desc(Qw + blk * BR * 128 + in_row, 16, "
                              "1024);"),
    "k_desc": ("09_wgmma.cu", "const uint64_t b = wgmma_desc(Kt + blk * BC * 128 + in_row, 16, "
                              "1024);"),
    "k_step": ("09_wgmma.cu", "const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;"),
    "ring_ahead": ("09_wgmma.cu", "constexpr int AHEAD = RETIRE ? STAGES - 1 : STAGES - 2;"),
    "ring_with_q": ("09_wgmma.cu", "if (next < STAGES - 1) return;  // copied with Q"),
    "ring_issue": ("09_wgmma.cu", "const int next = j + AHEAD;"),
    "v_desc": ("09_wgmma.cu", "wgmma_rs<T, D, 1>(o, p[ks], wgmma_desc(Vt + ks * 16 * 128, "
                              "BC * 128, 1024), 1);"),
    "tma_tile": ("10_tma.cu", "tma_load_4d(dst + blk * ROWS * 128, &map, bar, blk * 64, at(1), "
                              "at(2), at(3));"),
    "expect_tx": ("10_tma.cu", "mbar_arrive_expect_tx(full + 8 * nb, 2 * Cfg::KV_BYTES);"),
    "full_wait": ("10_tma.cu", "mbar_wait(full + 8 * buf, (j / STAGES) & 1);"),
    "empty_wait": ("10_tma.cu", "if (next >= STAGES) mbar_wait(empty + 8 * nb, "
                                "(next / STAGES - 1) & 1);"),
    "release": ("10_tma.cu", "if (j > 0 && lane == 0) mbar_arrive(empty + 8 * ((j - 1) % "
                             "STAGES));"),
    "ahead": ("10_tma.cu", "constexpr int AHEAD = RETIRE ? STAGES - 1 : STAGES - 2;"),
    "first_tiles": ("10_tma.cu", "for (int st = 0; st < STAGES - 1 && st < n_tiles; st++) {"),
    "producer_regs": ("11_warpspec.cu", "static constexpr int PRODUCER_REGS = CONSUMERS == 3 || "
                                        "BLOCKS == 2 ? 32 : 40;"),
    "consumer_regs": ("11_warpspec.cu", "static constexpr int CONSUMER_REGS = (ENTRY_REGS * (1 + "
                                        "CONSUMERS) - PRODUCER_REGS) / CONSUMERS / 8 * 8;"),
    "entry_regs": ("11_warpspec.cu", "static constexpr int ENTRY_REGS = 65536 / BLOCKS / THREADS "
                                     "/ 8 * 8;"),
    "work_tile": ("11_warpspec.cu", "q0 = (causal ? tiles - 1 - qt : qt) * BR;"),
    "first_item": ("11_warpspec.cu", "int ring = 0, item = blockIdx.x;"),
    "claim": ("11_warpspec.cu", "item = gridDim.x + atomicAdd(next_item, 1);"),
    "q_slot": ("11_warpspec.cu", "if (it >= 2) mbar_wait(q_empty + 8 * slot, ((it >> 1) - 1) & "
                                 "1);"),
    "k_with_v": ("11_warpspec.cu", "if (j > 0) load(Vs, v_full, v_empty, maps.v, j - 1);"),
    "k_release": ("11_warpspec.cu", "mbar_arrive(k_empty + 8 * buf);"),
    "o_global": ("11_warpspec.cu", "*reinterpret_cast<uint32_t*>(Ob + r * L.o.n + 8 * d + 2 * "
                                   "t) ="),
    "lazy_units": ("13_lazy_rescale.cu", "grow |= x * scale_log2 > m[hh] + 8.f;"),
    "o_shared": ("12_tma_store.cu", "at = Qw + (d / 8) * BR * 128 + row * 128 + (((d % 8) ^ "
                                    "(row % 8)) << 4) + 4 * t;"),
}


@pytest.mark.parametrize("stages, retire", [(3, False), (4, False), (2, True), (3, True)])
def test_ring_steps_never_refill_a_buffer_in_use(stages, retire):
    """Stage 09's ring: a tile lands before the iteration that reads it, a buffer's next load
    starts only once the P·V of its last tile is done, and loads run AHEAD tiles ahead."""
    df = wgmma.ring_steps(n_tiles=9, stages=stages, retire=retire)
    assert (df["ahead"] == (stages - 1 if retire else stages - 2)).all()
    for buf, rows in df.groupby("buffer"):
        spans = sorted(zip(rows.start, rows.end))
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), buf
    loads = df[df.what == "load"].set_index("tile")
    assert (loads.end == loads.index).all()
    assert (loads.start[loads.index < stages - 1] == -1).all()
    later = loads[loads.index >= stages - 1]
    assert (later.index - later.start == df["ahead"].iloc[0]).all()
    with pytest.raises(ValueError):
        wgmma.ring_steps(stages=2, retire=False)


def test_models_quote_the_kernels():
    for name, (file, text) in SOURCE.items():
        assert text in (KERNELS / file).read_text(), f"{name}: {file} no longer has {text!r}"


# ---------------------------------------------------------------- TMA and the ring

def test_tma_boxes():
    b = tma.tma_boxes(N=300, D=128, BC=128, tile=2)
    assert list(b.col0) == [0, 64] and list(b.dst) == [0, 128 * 128]
    assert b.bytes.sum() == 128 * 128 * 2 and (b.zero_rows == 84).all()
    assert (tma.tma_boxes(N=256, tile=1).zero_rows == 0).all()
    with pytest.raises(ValueError):
        tma.tma_boxes(N=300, tile=3)


PLANS = [dict(), dict(stages=4), dict(stages=3, latency=0.0), dict(stages=5, latency=3.0),
         dict(stages=4, compute=[1.5, 2.5]), dict(stages=3, compute=[3.0, 1.0], warpgroups=2),
         dict(n_tiles=12, stages=4, load=2.0, compute=1.0, latency=2.0, warpgroups=1),
         dict(n_tiles=1), dict(n_tiles=2, stages=6)]


@pytest.mark.parametrize("kw", PLANS)
def test_ring_invariants(kw):
    df = tma.ring_schedule(**kw)
    n, stages = len(df), kw.get("stages", 3)
    latency, load = kw.get("latency", 1.0), kw.get("load", 1.0)
    assert (df.buffer == df.index % stages).all()
    for _, rows in df.groupby("buffer"):                        # parities alternate per buffer
        assert list(rows.parity) == [k % 2 for k in range(len(rows))]
    assert (df.arrive >= df.issue + latency + load - 1e-9).all()
    for j in range(stages, n):                                  # no refill before the release
        assert df.issue[j] >= df.release[j - stages] - 1e-9
    for j in range(min(stages - 1, n)):                         # the first stages - 1: with Q
        assert df.issue[j] == 0
    for j in range(stages - 1, n):                              # issued at iteration j - AHEAD
        assert df.issue[j] >= df.compute_start_wg0[j - (stages - 2)] - 1e-9
    wgs = kw.get("warpgroups", 2)
    for w in range(wgs):
        start, end = df[f"compute_start_wg{w}"], df[f"compute_end_wg{w}"]
        assert (start >= df.arrive - 1e-9).all()                # waits for full[b]
        assert (start.iloc[1:].to_numpy() >= end.iloc[:-1].to_numpy() - 1e-9).all()
        assert (df.release >= end - 1e-9).all()
    assert (df.stall >= 0).all()


def test_ring_steady_state():
    three = tma.ring_schedule(n_tiles=16)                       # one tile ahead: latency-bound
    assert np.allclose(np.diff(three.compute_start_wg0)[-5:], 2.0)
    four = tma.ring_schedule(n_tiles=16, stages=4)              # two ahead: compute-bound
    assert np.allclose(np.diff(four.compute_start_wg0)[-5:], 1.5)
    slow = tma.ring_schedule(n_tiles=16, stages=3, compute=[1.0, 3.0])
    assert slow.stall.sum() > 0                                 # wg 1 holds the elected thread
    assert np.allclose(np.diff(slow.compute_start_wg0)[-5:], 3.0)
    with pytest.raises(ValueError):
        tma.ring_schedule(stages=2)


# ---------------------------------------------------------------- stage 11: registers

def _kernel_producer_regs():
    """PRODUCER_REGS as 11_warpspec.cu sets it: (kept with three consumers, kept otherwise)."""
    import re
    text = (KERNELS / "11_warpspec.cu").read_text()
    m = re.search(r"static constexpr int PRODUCER_REGS = CONSUMERS == 3 \|\| BLOCKS == 2 \? (\d+) : "
                  r"(\d+);", text)
    return int(m.group(1)), int(m.group(2))


def test_register_budgets_are_the_kernels():
    three, other = _kernel_producer_regs()
    assert [warpspec.producer_registers(c) for c in (1, 2, 3, 4)] == [other, other, three, other]
    assert warpspec.producer_registers(2, blocks=2) == three
    b = warpspec.register_budget(2)
    assert list(b.role) == ["producer", "consumer", "consumer"]
    assert list(b.entry) == [168] * 3 and list(b.after) == [other, 232, 232]
    assert warpspec.register_budget(3).after.tolist() == [three, 160, 160, 160]
    assert warpspec.register_budget(3, 40).after.tolist() == [40, 152, 152, 152]  # too few: C7512
    assert warpspec.entry_registers(384) == 168 and warpspec.entry_registers(512) == 128
    two = warpspec.register_budget(2, blocks=2)                 # two blocks an SM (D = 64, causal)
    assert list(two.entry) == [80] * 3 and list(two.after) == [three, 104, 104]
    # 640 threads start at 96
    assert warpspec.register_budget(4, 24).after.tolist() == [24] + [112] * 4
    assert warpspec.entry_registers(256) == 255 and warpspec.entry_registers(128) == 255
    assert warpspec.accumulator_registers(128, 128) == {"O": 64, "S": 64, "P": 32}
    assert sum(warpspec.accumulator_registers(64, 128).values()) == 128


@pytest.mark.parametrize("consumers", [1, 2, 3, 4])
@pytest.mark.parametrize("producer", [24, 40, 56, 64, 128])
def test_register_budgets_fit_the_sm(consumers, producer):
    b = warpspec.register_budget(consumers, producer)
    assert len(b) == consumers + 1 and (b.threads == 128).all()
    assert b.after_total.sum() <= b.entry_total.sum() <= warpspec.REGS_PER_SM  # within the pool
    assert (b.after % 8 == 0).all() and ((b.entry % 8 == 0) | (b.entry == 255)).all()
    assert (b.after <= 256).all() and (b.entry <= 255).all()
    cons = b.after.iloc[1]
    if cons < 256:                                              # nothing left to hand out
        assert b.entry_total.sum() - b.after_total.sum() < 128 * 8 * consumers
    entry = b.entry.iloc[0]                                     # what the producer gives, they get
    assert (cons - entry) * (entry - producer) >= 0


def test_setmaxnreg_takes_multiples_of_8_from_24_to_256():
    for bad in (16, 20, 41, 264):
        with pytest.raises(ValueError):
            warpspec.consumer_registers(2, bad)
    with pytest.raises(ValueError):
        warpspec.entry_registers(200)                           # not whole warpgroups
    with pytest.raises(ValueError):
        warpspec.consumer_registers(0)


# ---------------------------------------------------------------- stage 11: claiming work items

CLAIMS = [(4, 8, 8), (6, 8, 16), (2, 16, 8), (8, 8, 8), (16, 4, 8), (3, 12, 12), (5, 7, 3),
          (1, 3, 8), (32, 64, 132), (16, 128, 132)]


@pytest.mark.parametrize("heads, tiles, blocks", CLAIMS)
@pytest.mark.parametrize("policy", warpspec.CLAIM_POLICIES)
@pytest.mark.parametrize("causal", [True, False])
def test_claim_schedule_invariants(heads, tiles, blocks, policy, causal):
    s = warpspec.claim_schedule(heads, tiles, blocks, causal, policy)
    items, grid = heads * tiles, min(blocks, heads * tiles)
    assert list(s.index) == list(range(items)) and set(s.block) <= set(range(grid))
    assert (s.end - s.start == s.cost).all() and (s.start >= s.claimed).all()
    assert (s["head"] == s.index // tiles).all()
    if causal:                                                  # longest first within a head
        assert (s.cost == s.qt + 1).all() and (s.qt == tiles - 1 - s.index % tiles).all()
    else:
        assert (s.cost == tiles).all()
    for _, mine in s.sort_values("start").groupby("block"):     # a block does one item at a time
        assert (mine.start.iloc[1:].to_numpy() >= mine.end.iloc[:-1].to_numpy() - 1e-9).all()
        assert mine.start.iloc[0] == 0
    bound = s.cost.sum() / grid
    assert s.end.max() >= bound - 1e-9
    if policy != "static":                                      # list scheduling's guarantee
        assert s.end.max() <= bound + 2 * s.cost.max() + 1e-9
    if policy == "counter":
        assert list(s.block.iloc[:grid]) == list(range(grid))  # block b's first item is b
        later = s.iloc[grid:]
        assert (np.diff(later.claimed) >= -1e-9).all()          # the counter serves claims in order
        for b, mine in s.groupby("block"):                      # claimed once the one before has
            mine = mine.sort_values("start")                    # issued its copies: 2 tiles early
            before = np.maximum(mine.start.iloc[:-1], mine.end.iloc[:-1] - 2)
            assert np.allclose(mine.claimed.iloc[1:], before)
            assert np.allclose(mine.start.iloc[1:], mine.end.iloc[:-1])
    if policy == "static":
        assert (s.block == s.index % grid).all()


@pytest.mark.parametrize("heads, tiles, blocks", CLAIMS[:6])
def test_the_counter_beats_a_static_split_of_causal_items(heads, tiles, blocks):
    """Where the grid lines up with a head's tiles, a static split hands every block the same
    query tile of each head; the counter finishes earlier, and longest-first no later."""
    static = warpspec.claim_schedule(heads, tiles, blocks, True, "static").end.max()
    counter = warpspec.claim_schedule(heads, tiles, blocks, True, "counter").end.max()
    in_order = warpspec.claim_schedule(heads, tiles, blocks, True, "counter", longest_first=False)
    assert counter < static
    assert counter <= in_order.end.max()


def test_claim_makespans():
    df = warpspec.claim_makespans([(4, 8), (16, 4)], blocks=8)
    assert list(df.index) == [(4, 8), (16, 4)] and list(df["items"]) == [32, 64]
    assert df.loc[(4, 8), "static"] == 32 and df.loc[(4, 8), "counter"] == 19
    # claimed as an item starts (a whole item ahead), the counter would end at 22; claimed at the
    # last moment, as the block scheduler does, at 18
    assert [warpspec.claim_schedule(4, 8, 8, ahead=a).end.max() for a in (100, 0)] == [22, 18]
    assert df.loc[(4, 8), "hardware"] == 18 == df.loc[(4, 8), "even_split"]
    assert np.isclose(df.loc[(4, 8), "static over even"], 32 / 18 - 1)
    with pytest.raises(ValueError):
        warpspec.claim_schedule(policy="round robin")


def test_items_of_more_rows_than_keys_read_up_to_their_last_row():
    """Stage 11 at D = 64: 192-row items (three consumers) over 128-key tiles. N = 512 is three
    items a head; under the mask, longest first, they read 4, 3 and 2 key tiles (rows 384-511,
    192-383, 0-191), without it all 4."""
    assert [warpspec.item_tiles(i, 3, True, rows=192, keys=128, n=512)
            for i in range(3)] == [4, 3, 2]
    assert [warpspec.item_tiles(i, 3, True, False, 192, 128, 512) for i in range(3)] == [2, 3, 4]
    assert warpspec.item_tiles(0, 3, False, rows=192, keys=128, n=512) == 4
    # rows = keys and n a multiple: query tile t reads key tiles 0..t, as before
    assert [warpspec.item_tiles(i, 4, True) for i in range(4)] == [4, 3, 2, 1]
    s = warpspec.claim_schedule(2, 3, 4, rows=192, keys=128, n=512)
    assert list(s.cost) == [4, 3, 2, 4, 3, 2]
    df = warpspec.claim_makespans([(2, 3, 192, 128, 512)], blocks=4)
    assert df.loc[(2, 3), "even_split"] == 18 / 4
    with pytest.raises(ValueError, match="do not cover"):
        warpspec.item_tiles(0, 2, True, rows=192, keys=128, n=512)


# ---------------------------------------------------------------- stage 11: the schedule

TIMES = [dict(), dict(latency=3.0, load=2.0), dict(latency=0.0, load=0.2, issue=0.0, launch=0.0),
         dict(mma=0.5, softmax=2.0, q_load=1.0, store=1.0), dict(latency=1.5, load=0.75)]
ITEMS = [(4, 4, 4), (1,), (1, 5, 2, 3), (12,)]


def _no_overlap(work):
    for _, lane in work.sort_values("start").groupby("lane"):
        assert (lane.start.iloc[1:].to_numpy() >= lane.end.iloc[:-1].to_numpy() - 1e-9).all()


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("tiles", ITEMS)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_producer_never_overwrites_a_buffer_before_its_release(times, tiles, stages):
    s = warpspec.warpspec_schedule(tiles=tiles, stages=stages, **times)
    latency = times.get("latency", 1.0)
    c, w = s.copies, s.work
    assert (c.arrive >= c.issue + latency - 1e-9).all() and (c.release >= c.arrive - 1e-9).all()
    assert (np.diff(c.issue) >= -1e-9).all()                    # one thread, in program order
    for kind in ("K", "V"):
        ring = c[c.what == kind].reset_index(drop=True)
        assert len(ring) == sum(tiles)
        assert (ring.buffer == ring.index % stages).all()
        for r in range(stages, len(ring)):
            assert ring.issue[r] >= ring.release[r - stages] - 1e-9
    q = c[c.what == "Q"].reset_index(drop=True)
    assert (q.buffer == q.index % 2).all()
    for k in range(2, len(q)):
        assert q.issue[k] >= q.release[k - 2] - 1e-9
    # K_j is issued before V_{j-1}, and V_{j-1} before K_{j+1}: the consumers' order
    order = [(r.what, r.item, r.tile) for r in c.itertuples()]
    for k, n in enumerate(tiles):
        assert order.index(("K", k, 0)) == order.index(("Q", k, -1)) + 1
        for j in range(1, n):
            assert order.index(("V", k, j - 1)) == order.index(("K", k, j)) + 1
    # the consumers wait for their data
    arrive = {(r.what, r.item, r.tile): r.arrive for r in c.itertuples()}
    for r in w[w.kind.isin(["S", "PV"])].itertuples():
        need = arrive[("K" if r.kind == "S" else "V", r.item, r.tile)]
        assert r.start >= need - 1e-9
        if r.kind == "S" and r.tile == 0:
            assert r.start >= arrive[("Q", r.item, -1)] - 1e-9
    _no_overlap(w)
    assert np.isclose(s.total, w.end.max())


@pytest.mark.parametrize("times", TIMES)
@pytest.mark.parametrize("tiles", ITEMS)
def test_stage10_ring_and_stage11_is_no_slower(times, tiles):
    s10 = warpspec.elected_schedule(tiles=tiles, stages=3, **times)
    c, w = s10.copies, s10.work
    kv = c[c.what == "KV"]
    for k, block in kv.groupby("item"):
        block = block.set_index("tile")
        for j in block.index:
            if j >= 3:
                assert block.issue[j] >= block.release[j - 3] - 1e-9
    for r in w[w.kind == "S"].itertuples():
        assert r.start >= kv[(kv.item == r.item) & (kv.tile == r.tile)].arrive.iloc[0] - 1e-9
    starts = w[w.kind == "launch"].groupby("item").start.min()
    ends = w[w.kind == "store"].groupby("item").end.max()
    # one block at a time: the next starts after the last one's store
    assert (starts.iloc[1:].to_numpy() >= ends.iloc[:-1].to_numpy() - 1e-9).all()
    _no_overlap(w)
    s11 = warpspec.warpspec_schedule(tiles=tiles, stages=2, **times)
    assert s11.total <= s10.total + 1e-9


def test_the_steady_state_is_the_math_when_copies_keep_up():
    times = dict(latency=1.0, load=0.5, mma=1.0, softmax=1.0, issue=0.0)
    for sched in (warpspec.elected_schedule(tiles=(16,), stages=3, **times),
                  warpspec.warpspec_schedule(tiles=(16,), stages=2, **times)):
        s = sched.work[(sched.work.kind == "S") & sched.work.lane.isin(["wg 0", "consumer 1"])]
        assert np.allclose(np.diff(s.start)[-6:], 2.0)
    slow = dict(times, latency=1.5, load=0.75)                  # stage 10 waits every tile
    ten = warpspec.elected_schedule(tiles=(16,), stages=3, **slow).work
    eleven = warpspec.warpspec_schedule(tiles=(16,), stages=2, **slow).work
    assert np.diff(ten[(ten.kind == "S") & (ten.lane == "wg 0")].start)[-1] > 2.0 + 1e-9
    assert np.isclose(np.diff(eleven[(eleven.kind == "S")
                                     & (eleven.lane == "consumer 1")].start)[-1], 2.0)


def test_predicted_gain_fades_with_the_item():
    g = warpspec.predicted_gain(n_tiles=(4, 16, 128), mma=1.0, softmax=1.0, latency=1.0, load=0.5)
    assert (g > 1).all() and g.is_monotonic_decreasing and g[128] < 1.02
    with pytest.raises(ValueError):
        warpspec.warpspec_schedule(stages=1)
    with pytest.raises(ValueError):
        warpspec.elected_schedule(stages=2)
    with pytest.raises(ValueError):
        warpspec.warpspec_schedule(load=-1)


# ---------------------------------------------------------------- figures

FIGURES = [lambda: wgmma.accumulator_figure(64), lambda: wgmma.accumulator_figure(128),
           lambda: wgmma.descriptor_figure(), lambda: wgmma.descriptor_figure(
               wgmma.encode_descriptor(0x12340, 128 * 128, 1024)),
           lambda: wgmma.swizzle_figure(128), lambda: wgmma.swizzle_figure(64),
           lambda: wgmma.ring_figure(), lambda: wgmma.ring_figure(3, rings=((4, False),)),
           lambda: tma.tma_box_figure(), lambda: tma.tma_box_figure(N=200, D=64, BC=64, tile=1),
           lambda: tma.ring_timeline(), lambda: tma.ring_timeline(stages=4, compute=[1.5, 2.0]),
           lambda: warpspec.register_figure(), lambda: warpspec.register_figure((1, 2), D=64),
           lambda: warpspec.claim_figure(),
           lambda: warpspec.claim_figure(heads=3, tiles=5, blocks=4, causal=False),
           lambda: warpspec.warpspec_timeline(),
           lambda: warpspec.warpspec_timeline(tiles=(2, 5), latency=2.0),
           lambda: tma_store.o_store_figure(), lambda: tma_store.o_store_figure(D=128, d=3),
           lambda: lazy_rescale.lazy_figure(), lambda: lazy_rescale.lazy_figure(D=64, BC=64)]


@pytest.mark.parametrize("make", FIGURES)
def test_figures_draw(make):
    fig = make()
    assert isinstance(fig, Figure) and fig.axes
    fig.savefig(io.BytesIO(), format="png", dpi=30)


def test_frames_are_dataframes():
    for df in (wgmma.accumulator_owner(), wgmma.a_fragment_owner(), wgmma.swizzle_banks(128),
               tma.ring_schedule(), wgmma.kernel_descriptors(), wgmma.ring_steps(), tma.tma_boxes(),
               warpspec.register_budget(), warpspec.claim_schedule(),
               warpspec.warpspec_schedule().work, warpspec.warpspec_schedule().copies,
               warpspec.elected_schedule().work, tma_store.o_store_requests(),
               lazy_rescale.lazy_steps()):
        assert isinstance(df, pd.DataFrame) and len(df)


# ---------------------------------------------------------------- stage 13: the lazy rescale

def test_lazy_steps_drop_the_rescale_and_the_factor():
    for D in (64, 128):
        steps = lazy_rescale.lazy_steps(D=D)
        saved = steps.at["total", "stage 12"] - steps.at["total", "stage 13"]
        assert saved == D // 2 + 6 + 2 - 5  # O's rescale, m and alpha, two FMNMX; the vote added
        assert steps.at["exponentials (MUFU.EX2)", "stage 13"] == 64


def test_the_lazy_model_is_shorter_and_its_exponentials_start_at_once():
    chain = lazy_rescale.lazy_chain(D=128)
    end = {s: max(a + n for _, a, n in steps) for s, steps in chain.items()}
    assert end["stage 13"] < end["stage 12"]
    assert dict((n, a) for n, a, _ in chain["stage 13"])["exponentials, sums, P"] == 0
    assert dict((n, a) for n, a, _ in chain["stage 12"])["exponentials, sums, P"] > 100


def test_lazy_fallbacks_random_inputs_never_and_growing_keys_often():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((1024, 64)), rng.standard_normal((1024, 64))
    for causal in (False, True):
        r = lazy_rescale.lazy_fallbacks(q, k, causal=causal)
        assert r["classic"] == 0 and r["lazy"] > 0
        assert r["largest lazy P"] <= 2 ** lazy_rescale.LAZY_UNITS
    grow = lazy_rescale.lazy_fallbacks(q, k * (1 + 30 * np.arange(1024) / 1024)[:, None])
    assert grow["classic share"] > 0.5
    assert grow["largest lazy P"] <= 2 ** lazy_rescale.LAZY_UNITS


def test_lazy_fallbacks_counts_a_jump_by_hand():
    """Two tiles of one 16-row warp: a score 9 log2 units above the first tile's maximum is a
    fallback, 7 is not."""
    d = 4
    q = np.zeros((16, d))
    q[:, 0] = 1.0
    scale_log2 = lazy_rescale.LOG2E / 2  # 1 / sqrt(4), in log2 units
    for jump, classic in ((9.0, 1), (7.0, 0)):
        k = np.zeros((256, d))
        k[:128, 0] = 1.0 / scale_log2   # first tile: every score 1 (log2 units)
        k[200, 0] = (1.0 + jump) / scale_log2
        r = lazy_rescale.lazy_fallbacks(q, k, BC=128)
        assert (r["classic"], r["lazy"]) == (classic, 1 - classic)
