"""Development harness for the Hopper stages (device only): where a consumer warpgroup's time goes,
tile by tile, read from the SM's own clock.

    python3 tools/hopper_trace.py scratch/11_traced.cu "wait data,S,softmax,P V" [--D 128 --N 4096]

The kernel is a copy of a stage with STAMP(k) lines in its consumer loop (k = 0 .. 7, in the
order the loop reaches them), `int tr = 0;` before the loop and `tr++;` once per tile. This tool
adds what they need before building: a __device__ table g_trace[warpgroup][tile][stamp] of
clock64() values written by thread 0 of consumer warpgroups 0 and 1 (`cw`) of block 0 only, and
an exported flashlab_trace() that copies it to the host. It runs the kernel, then prints for each
consumer the mean cycles from stamp k to stamp k + 1 (the names given, one per interval), the
period from one tile's stamp 0 to the next, and how far apart the two consumers run.

The stamps cost a store each, and only block 0 writes them: a trace shows the schedule, not the
kernel's speed (time that with tools/hopper_try.py).
"""
import argparse
import ctypes
import tempfile
from pathlib import Path

import numpy as np
import torch

import flashlab as fl
from flashlab import build
from flashlab.runtime import Attention

TILES, STAMPS = 256, 8
PRELUDE = f"""
__device__ unsigned long long g_trace[2][{TILES}][{STAMPS}];
extern "C" int flashlab_trace(void* host) {{
  return (int)cudaMemcpyFromSymbol(host, g_trace, sizeof(g_trace));
}}
extern "C" int flashlab_trace_clear() {{
  static unsigned long long zeros[2][{TILES}][{STAMPS}];
  return (int)cudaMemcpyToSymbol(g_trace, zeros, sizeof(g_trace));
}}
#define STAMP(k)                                                                  \\
  if (blockIdx.x == 0 && threadIdx.x % 128 == 0 && cw < 2 && tr < {TILES})        \\
    g_trace[cw][tr][k] = clock64();
"""


def traced_source(text: str) -> str:
    """`text` with the trace table, its export and STAMP after the last #include."""
    lines = text.splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if line.startswith("#include"))
    return "".join(lines[:last + 1]) + PRELUDE + "".join(lines[last + 1:])


def phases(trace: np.ndarray, names, skip=8):
    """{consumer: {name: mean cycles}} from a (2, TILES, STAMPS) clock table; tiles before
    `skip` (the pipeline filling) and unwritten ones are left out."""
    out = {}
    for wg in range(trace.shape[0]):
        rows = trace[wg, skip:, :len(names) + 1].astype(np.int64)
        rows = rows[(rows > 0).all(axis=1)]
        back = np.flatnonzero(np.diff(rows[:, 0]) <= 0)  # the clock never runs backwards within
        if len(back):                                    # one launch: what follows is not ours
            rows = rows[:back[0] + 1]
        if len(rows) < 2:
            continue
        stats = {n: float(np.mean(rows[:, i + 1] - rows[:, i])) for i, n in enumerate(names)}
        stats["period"] = float(np.mean(np.diff(rows[:, 0])))
        out[wg] = stats
    return out


def stamps_written(trace: np.ndarray, skip=8) -> int:
    """How many stamps (0, 1, ...) the kernel wrote in every tile it traced: a name is needed
    for each interval between them."""
    t = trace[:, skip:, :]
    traced = (t[:, :, 0] > 0)
    if not traced.any():
        return 0
    full = [bool((t[:, :, k][traced] > 0).all()) for k in range(t.shape[2])]
    return full.index(False) if False in full else len(full)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("names", help="comma-separated names of the intervals between stamps")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    names = [n.strip() for n in args.names.split(",")]
    src = Path(tempfile.mkdtemp()) / Path(args.source).name
    src.write_text(traced_source(Path(args.source).read_text()))
    from hopper_try import unregistered_stage  # its neighbour in tools/ (run as a script)
    st = unregistered_stage(src)
    mod = build.build_module(src, arch=st.arch((9, 0)))
    attn = Attention(st, mod)
    cfg = fl.Config(16384 // args.N, 2048 // args.D, args.N, args.D, args.causal, "fp16")
    q, k, v = cfg.inputs()
    for _ in range(3):
        attn(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    # The persistent grid hands block 0 a different number of items from launch to launch: the
    # table is cleared before the launch that is read, or an earlier launch's stamps stay behind.
    lib = ctypes.CDLL(mod.__file__)
    if lib.flashlab_trace_clear() != 0:
        raise SystemExit("cudaMemcpyToSymbol failed")
    attn(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    table = np.zeros((2, TILES, STAMPS), dtype=np.uint64)
    if lib.flashlab_trace(table.ctypes.data_as(ctypes.c_void_p)) != 0:
        raise SystemExit("cudaMemcpyFromSymbol failed")
    written = stamps_written(table)
    if written != len(names) + 1:
        raise SystemExit(f"the kernel wrote {written} stamps a tile: give {max(written - 1, 0)} "
                         f"names, one per interval between them, not {len(names)}")
    print(f"{torch.cuda.get_device_name()} {cfg.label}: mean cycles per tile, block 0")
    for wg, stats in phases(table, names).items():
        print(f"consumer {wg}: " + "  ".join(f"{n} {v:.0f}" for n, v in stats.items()))
    t = table.astype(np.int64)[:, 8:, 0]
    ok = (t > 0).all(axis=0)
    if ok.sum() > 1:
        print(f"consumer 1's stamp 0 after consumer 0's: {np.median(t[1, ok] - t[0, ok]):.0f} cycles")


if __name__ == "__main__":
    main()
