"""Stage 01 beside the published flash-attention-minimal kernel, timed in one process.

    git clone https://github.com/tspeterkim/flash-attention-minimal /tmp/fam
    python tools/compare_minimal.py /tmp/fam            # records data/minimal.csv

Stage 01 keeps the published kernel's algorithm, tiles and memory-access pattern, yet runs
faster. This script finds out why, one difference at a time, at the teaching config (fp32):

  published           the published extension built the way its README builds it (main.cpp and
                      flash.cu through torch.utils.cpp_extension.load, -O2), calling its
                      forward(): host-side allocations of l and m and their copies to the GPU,
                      a device-attribute query and a printf, then the kernel
  published_kernel    the same forward_kernel, compiled alone with the same flags and launched
                      with preallocated O, l, m (reset before each call, as forward() does)
  published_kernel_O3 the same, compiled with flashlab's flags (-O3 -lineinfo)
  constexpr_tiles     + Bc and Br compile-time constants (32) instead of kernel arguments
  constexpr_tiles_64  + 64-bit offsets into Q, K, V, O (as stage 01 has)
  01_naive            stage 01 as flashlab builds it

The variants are text edits of the checkout's flash.cu made in a temporary directory; nothing
of the published code is written into this repository. Every variant is checked against the
float64 reference on the same inputs and timed by flashlab.bench.time_fn (warmed, L2 flushed,
median of >= 20, re-timed when unsettled).
"""
import argparse
import contextlib
import ctypes
import hashlib
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashlab import build, env, tables  # noqa: E402
from flashlab.stages import stage  # noqa: E402
from flashlab.bench import time_fn  # noqa: E402
from flashlab.configs import TEACHING
from flashlab.reference import reference, rel_err  # noqa: E402

LAUNCHER = r"""
extern "C" int flm_launch(const float* Q, const float* K, const float* V, float* l, float* m,
                          float* O, int B, int nh, int N, int d) {
  const int Bc = 32, Br = 32;
  const int Tc = (N + Bc - 1) / Bc, Tr = (N + Br - 1) / Br;
  const float softmax_scale = 1.0f / sqrtf((float)d);
  const int sram_size = (3 * Bc * d + Bc * Br) * sizeof(float);
  forward_kernel<<<dim3(B, nh), dim3(Br), sram_size>>>(Q, K, V, N, d, Tc, Tr, Bc, Br,
                                                       softmax_scale, l, m, O);
  return (int)cudaGetLastError();
}
"""

# (variant, description, [(old, new) text edits of forward_kernel], nvcc flags)
TORCH_FLAGS = ["-O2"]  # what the README's load() adds; ptxas optimises device code at -O3 either way
EDITS_CONSTEXPR = [("    const int Bc,\n    const int Br,\n", "    const int Bc_arg,\n    const int Br_arg,\n"),
                   ("    int tx = threadIdx.x;\n", "    constexpr int Bc = 32, Br = 32;\n    int tx = threadIdx.x;\n")]
EDITS_64 = [("int qkv_offset = (bx * gridDim.y * N * d) + (by * N * d);",
             "size_t qkv_offset = ((size_t)bx * gridDim.y * N * d) + ((size_t)by * N * d);"),
            ("int lm_offset = (bx * gridDim.y * N) + (by * N);",
             "size_t lm_offset = ((size_t)bx * gridDim.y * N) + ((size_t)by * N);")]
VARIANTS = [
    ("published_kernel", "the published forward_kernel alone, preallocated O, l, m, -O2", [],
     TORCH_FLAGS),
    ("published_kernel_O3", "the same, flashlab's flags (-O3 -lineinfo)", [], build.NVCC_FLAGS),
    ("constexpr_tiles", "+ Bc, Br compile-time constants", EDITS_CONSTEXPR, TORCH_FLAGS),
    ("constexpr_tiles_64", "+ 64-bit offsets", EDITS_CONSTEXPR + EDITS_64, TORCH_FLAGS),
]


def forward_kernel(flash_cu: str) -> str:
    start = flash_cu.index("__global__\nvoid forward_kernel(")
    end = flash_cu.index("__global__", start + 10)
    return flash_cu[start:end]


def edited(kernel: str, edits) -> str:
    for old, new in edits:
        if kernel.count(old) != 1:
            sys.exit(f"compare_minimal: expected one {old!r} in forward_kernel; the published "
                     "code has changed, so this comparison no longer applies as written")
        kernel = kernel.replace(old, new)
    return kernel


def build_variant(kernel: str, flags, workdir: Path, name: str):
    src = workdir / f"{name}.cu"
    src.write_text("#include <cuda_runtime.h>\n#include <cmath>\n" + kernel + LAUNCHER)
    so = workdir / f"{name}.so"
    cc = torch.cuda.get_device_capability()
    cmd = [build.nvcc(), *flags, "-shared", "-Xcompiler", "-fPIC",
           f"-gencode=arch=compute_{cc[0]}{cc[1]},code=sm_{cc[0]}{cc[1]}", str(src), "-o", str(so)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    lib.flm_launch.restype = ctypes.c_int
    return lib


@contextlib.contextmanager
def quiet_stdout():
    """The published forward() printfs on every call; keep the log readable."""
    sys.stdout.flush()
    saved = os.dup(1)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", type=Path, help="a checkout of tspeterkim/flash-attention-minimal")
    ap.add_argument("--no-record", action="store_true", help="print only")
    args = ap.parse_args(argv)
    flash_cu = (args.checkout / "flash.cu").read_text()
    source = f"flash.cu sha256 {hashlib.sha256(flash_cu.encode()).hexdigest()[:12]}"
    try:  # the checkout's own commit, if it is a git checkout of its own
        git = lambda *a: subprocess.run(["git", "-C", str(args.checkout), *a], capture_output=True,
                                        text=True, check=True).stdout.strip()
        if Path(git("rev-parse", "--show-toplevel")).resolve() == args.checkout.resolve():
            source = git("rev-parse", "--short=12", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pass
    cfg = TEACHING
    B, H, N, D = cfg.B, cfg.H, cfg.N, cfg.D
    q, k, v = cfg.inputs("cuda", seed=0)
    ref = reference(q, k, v)
    timed = []  # (variant, description, callable, note)

    from torch.utils.cpp_extension import load
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ext = load(name="minimal_attn", sources=[str(args.checkout / "main.cpp"), str(args.checkout / "flash.cu")],
                   extra_cuda_cflags=TORCH_FLAGS, build_directory=str(tmp), verbose=False)

        def published():
            with quiet_stdout():
                return ext.forward(q, k, v)[0]
        timed.append(("published", "the published extension's forward(), built as its README builds it",
                      published, "includes its host-side allocations, copies and printf"))

        kernel = forward_kernel(flash_cu)
        O = torch.empty_like(q)
        lm = torch.empty(2, B, H, N, device="cuda")
        for name, desc, edits, flags in VARIANTS:
            lib = build_variant(edited(kernel, edits), flags, tmp, name)

            def call(lib=lib):
                O.zero_()
                lm[0].zero_()
                lm[1].fill_(-math.inf)
                err = lib.flm_launch(*(ctypes.c_void_p(t.data_ptr()) for t in (q, k, v, lm[0], lm[1], O)),
                                     B, H, N, D)
                if err:
                    raise RuntimeError(f"{name}: CUDA error {err}")
                return O
            timed.append((name, desc, call, "O, l, m reset before each call (three memsets)"))

        st = stage("01_naive")
        attn = st.build()
        timed.append((st.slug, "stage 01 as flashlab builds it", lambda: attn(q, k, v), ""))

        rows = []
        info = env.environment()
        for order, (name, desc, fn, note) in enumerate(timed):
            out = fn().clone()
            err = rel_err(out, ref)
            t = time_fn(fn)
            row = {"order": order, "variant": name, "description": desc, "B": B, "H": H, "N": N,
                   "D": D, "dtype": "fp32", "median_ms": t.median_ms, "p20_ms": t.p20_ms,
                   "p80_ms": t.p80_ms, "tflops": cfg.flops / t.median_ms / 1e9, "rel_err": err,
                   "runs": t.runs, "retimes": t.retimes, "published_source": source, **info,
                   "note": "; ".join(x for x in (note, t.note) if x)}
            rows.append(row)
            print(f"{name:22s} {t.median_ms:9.2f} ms  {row['tflops']:6.3f} TFLOP/s  rel err {err:.1e}"
                  f"  ({t.runs} runs, {t.retimes} re-timings)", flush=True)
            if not args.no_record:
                tables.MINIMAL.upsert([row])  # one row at a time: nothing timed is lost
    first, last = rows[0]["median_ms"], rows[-1]["median_ms"]
    print(f"stage 01 is {first / last:.2f}x faster than the published kernel on {info['gpu']}")


if __name__ == "__main__":
    main()
