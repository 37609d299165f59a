"""The GPU's own ceilings, measured rather than read off a datasheet: the roofline that every
stage is placed on."""
import torch

from .bench import time_fn
from .env import environment
from .tables import PEAKS

MATMUL_N = 8192
COPY_BYTES = 2**30


def measure(device="cuda"):
    """Rows of (metric, value, unit): fp32 and fp16 matmul TFLOP/s, device copy bandwidth."""
    rows = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means the CUDA cores' FMA, not TF32
    try:
        for dtype, metric in ((torch.float32, "matmul_fp32_tflops"),
                              (torch.float16, "matmul_fp16_tflops")):
            a = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=dtype)
            b = torch.randn(MATMUL_N, MATMUL_N, device=device, dtype=dtype)
            t = time_fn(lambda: a @ b, device=device)
            rows.append((metric, 2 * MATMUL_N**3 / (t.median_ms * 1e-3) / 1e12, "TFLOP/s"))
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
