"""The GPU's own ceilings, measured rather than read off a datasheet: the roofline that every
stage is placed on."""
import torch

from .bench import time_fn
from .env import environment
from .tables import PEAKS

MATMUL_SIZES = (4096, 8192)  # square matmuls; the ceiling is the best median of them all
REPEATS = 3  # timings per size: a power-limited GPU's clock moves between them
COPY_BYTES = 2**30


def matmul_tflops(dtype, device="cuda", sizes=MATMUL_SIZES, repeats=REPEATS) -> float:
    """The best median TFLOP/s of square randn matmuls over `sizes`, each timed `repeats` times.
    One median of one size is not a ceiling: on an H100 that its power limit throttles, the
    same 8192³ fp16 matmul measured 676 and 760 TFLOP/s in two sessions."""
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(repeats):
            t = time_fn(lambda a=a, b=b: a @ b, device=device)
            best = max(best, 2 * n**3 / (t.median_ms * 1e-3) / 1e12)
        del a, b
    return best


def measure(device="cuda"):
    """Rows of (metric, value, unit): fp32 and fp16 matmul TFLOP/s (matmul_tflops), device copy
    bandwidth."""
    rows = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means the CUDA cores' FMA, not TF32
    try:
        for dtype, metric in ((torch.float32, "matmul_fp32_tflops"),
                              (torch.float16, "matmul_fp16_tflops")):
            rows.append((metric, matmul_tflops(dtype, device), "TFLOP/s"))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    src = torch.empty(COPY_BYTES // 4, device=device, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=device)
    rows.append(("copy_tbps", 2 * COPY_BYTES / (t.median_ms * 1e-3) / 1e12, "TB/s (read + write)"))
    env = environment(device)
    return [dict(metric=m, value=v, unit=u, **env) for m, v, u in rows]


def record(rows):
    PEAKS.upsert(rows)
