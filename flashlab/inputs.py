"""Input checks shared by every stage: bad input gets a ValueError naming the problem, before any
kernel runs, so a wrong call never becomes a wrong answer, a hang or a CUDA fault."""
import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_of(name) -> torch.dtype:
    """torch dtype from 'fp32' / 'fp16' / 'bf16' (or a torch dtype)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def validate(who: str, q, k, v, dtypes=("fp32",), out=None):
    """Raise ValueError unless q, k, v (and out) are usable (B, H, N, D) CUDA tensors.

    The device is checked last so that every other rule can be tested without a GPU."""
    named = {"q": q, "k": k, "v": v}
    if out is not None:
        named["out"] = out
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(f"{who}: {name} must have rank 4 (B, H, N, D), got shape "
                             f"{tuple(t.shape)}")
    for name, t in named.items():
        if t.shape != q.shape:
            raise ValueError(f"{who}: {name} has shape {tuple(t.shape)} but q has {tuple(q.shape)}; "
                             "q, k and v must match")
    if q.numel() == 0:
        raise ValueError(f"{who}: empty input, shape {tuple(q.shape)} (B, H, N and D must all be >= 1)")
    if q.numel() >= 2**31:
        raise ValueError(f"{who}: {q.numel()} elements is too many for 32-bit indexing (< 2**31)")
    allowed = [dtype_of(d) for d in dtypes]
    for name, t in named.items():
        if t.dtype not in allowed:
            raise ValueError(f"{who}: {name} has dtype {t.dtype}; this stage takes "
                             f"{', '.join(str(d) for d in allowed)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{who}: {name} has dtype {t.dtype} but q has {q.dtype}")
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{who}: {name} is not contiguous; pass {name}.contiguous()")
        if t.data_ptr() % 16:
            raise ValueError(f"{who}: {name} is not 16-byte aligned; pass {name}.clone()")
    for name, t in named.items():
        if t.device.type != "cuda":
            raise ValueError(f"{who}: {name} is on {t.device}; flashlab kernels need CUDA tensors "
                             f"(move them with .cuda())")
        if t.device != q.device:
            raise ValueError(f"{who}: {name} is on {t.device} but q is on {q.device}")
