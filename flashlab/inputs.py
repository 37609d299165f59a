"""Input checks shared by every stage: bad input gets a ValueError naming the problem, before any
kernel runs, so a wrong call never becomes a wrong answer, a hang or a CUDA fault."""
import torch

from .dtypes import DTYPES as _DTYPES
from .dtypes import NAMES

# flashlab.dtypes lists them; here each is a torch dtype
DTYPES = {d.name: getattr(torch, d.torch) for d in _DTYPES.values()}    # {"fp16": torch.float16}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}                 # {torch.float16: "fp16"}
DTYPE_CODES = {DTYPES[d.name]: d.code for d in _DTYPES.values()}        # {torch.float16: 1}


def dtype_of(name) -> torch.dtype:
    """torch dtype from 'fp32' / 'fp16' / 'bf16' (or a torch dtype)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(NAMES)}") from None


def random_qkv(cfg, device="cuda", seed=0) -> tuple:
    """Random q, k, v of config cfg's shape and dtype, from a seeded generator (never zeros:
    they hide unwritten output)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return tuple(torch.randn(cfg.B, cfg.H, cfg.N, cfg.D, generator=gen, device=device,
                             dtype=dtype_of(cfg.dtype)) for _ in range(3))


def strides(t) -> tuple:
    """(batch, head, row) strides of a (B, H, N, D) tensor in elements, 0 for a dim of size 1
    (where torch's stride means nothing and may be anything)."""
    (B, H, N), (sb, sh, sn) = t.shape[:3], t.stride()[:3]
    return (sb if B > 1 else 0, sh if H > 1 else 0, sn if N > 1 else 0)


def empty_in_order(t):
    """A new dense tensor of t's shape, dtype and device whose (batch, head, row) dims lie in
    memory in the order t's do (the last dim contiguous): contiguous for a contiguous t, and for
    the (B, H, N, D) view of a (B, N, H, D) projection the (B, H, N, D) view of a new (B, N, H, D)
    tensor. A gradient made so flows back into the projection without a permuting copy."""
    order = sorted(range(3), key=lambda i: (-t.stride(i) if t.shape[i] > 1 else 0, i))
    return torch.empty_permuted(tuple(t.shape), (*order, 3), dtype=t.dtype, device=t.device)


def aligned(t):
    """t, or a copy of it where its data does not start on a 16-byte boundary: what a backward
    reads (o, do) it may read 16 bytes at a time. (A contiguous tensor can start anywhere, a view
    of a larger buffer say; PyTorch's own allocations start on 512-byte boundaries.)"""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def gradient_problem(who, name, t, q):
    """Why a given gradient tensor (dq, dk or dv) cannot be written as `who`'s backward writes
    it, or None: it must be a contiguous tensor of q's shape, dtype and device, on a 16-byte
    boundary (the kernels store several elements at once)."""
    if (not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype
            or t.device != q.device or not t.is_contiguous()):
        return f"{who} backward: {name} must be a contiguous {q.dtype} tensor of shape " \
               f"{tuple(q.shape)} on {q.device}"
    if t.data_ptr() % 16:
        return f"{who} backward: {name} does not start on a 16-byte boundary; pass a new tensor"
    return None


def span(t) -> int:
    """1 + the largest element offset of t from its first element (numel for a contiguous t)."""
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _overlaps_itself(t) -> bool:
    """True when two elements of t share memory (an expanded view): unsafe to write."""
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1)
    extent = 1
    for s, n in dims:
        if s < extent:
            return True
        extent = s * n
    return False


def layout_problem(who: str, name: str, t, row_strides=False):
    """Why a stage cannot read (or write, name "out") t in place, or None. row_strides: the
    stage reads FlashlabLayout strides (see validate)."""
    if not row_strides:
        if not t.is_contiguous():
            return (f"{who}: {name} is not contiguous; pass {name}.contiguous() "
                    "(this stage reads contiguous (B, H, N, D) tensors only)")
    elif t.stride(3) != 1 and t.shape[3] > 1:
        return (f"{who}: {name}'s last dim is strided (stride {t.stride(3)}); the head dim must "
                f"be contiguous: pass {name}.contiguous()")
    elif any((s * t.element_size()) % 16 for s in strides(t)):
        return (f"{who}: {name} has strides {tuple(t.stride())}; every row must start on a "
                f"16-byte boundary (strides multiples of {16 // t.element_size()} elements): "
                f"pass {name}.contiguous()")
    elif name == "out" and _overlaps_itself(t):
        return (f"{who}: out has strides {tuple(t.stride())}, so several of its elements share "
                "memory; pass a tensor from torch.empty")
    if t.data_ptr() % 16:
        return f"{who}: {name} is not 16-byte aligned; pass {name}.clone()"
    return None


# Every rule below reads only a tensor's shape, strides, dtype, device and the 16-byte alignment
# of its first element. A model calls attention with the same few layouts in every layer, so
# validate keeps the descriptions of CUDA calls that passed (up to REMEMBERED) and runs the rules
# again only for a new one: a few microseconds of host time per call instead of about thirty.
# reads_in_place does the same for one tensor's layout.
_PASSED: set = set()
_IN_PLACE: set = set()
REMEMBERED = 4096  # the most any of flashlab's per-layout or per-problem memos keeps


def _remember(passed: set, seen):
    if len(passed) >= REMEMBERED:
        passed.clear()
    passed.add(seen)


def reads_in_place(who: str, name: str, t, row_strides=False) -> bool:
    """True where a stage can read (or write, name "out") t as it is: layout_problem finds
    nothing, remembered per (name, shape, strides, dtype, alignment)."""
    seen = (who, name, row_strides, t.shape, t.stride(), t.dtype, t.data_ptr() % 16)
    if seen in _IN_PLACE:
        return True
    if layout_problem(who, name, t, row_strides) is not None:
        return False
    _remember(_IN_PLACE, seen)
    return True


def _description(who, tensors, dtypes, row_strides, cuda_only=True):
    """What validate's rules read of a call, hashable; None unless every tensor is a tensor (on
    a GPU, with cuda_only)."""
    key = [who, dtypes, row_strides]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or (cuda_only and not t.is_cuda):
            return None
        key.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))
    return tuple(key)


def validate(who: str, q, k, v, dtypes=("fp32",), out=None, row_strides=False):
    """Raise ValueError unless q, k, v (and out) are usable (B, H, N, D) CUDA tensors.

    row_strides=False: each must be contiguous. True (stages that read FlashlabLayout): any
    (B, H, N, D) view whose last dim is contiguous and whose rows start on 16-byte boundaries,
    such as the (B, H, N, D) view of a (B, N, H, D) projection; out must not overlap itself.
    The device is checked last so that every other rule can be tested without a GPU."""
    seen = _description(who, (q, k, v) if out is None else (q, k, v, out), tuple(dtypes),
                        row_strides)
    if seen is not None and seen in _PASSED:
        return
    _check(who, q, k, v, dtypes, out, row_strides)
    if seen is not None:
        _remember(_PASSED, seen)


def _check(who, q, k, v, dtypes, out, row_strides):
    """validate's rules, in the order their messages are meant to be met."""
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
    for name, t in named.items():  # kernels index in 32-bit ints: every element within 2**31
        if span(t) >= 2**31:
            what = (f"{t.numel()} elements is" if t.is_contiguous() else
                    f"its strides {tuple(t.stride())} reach element {span(t) - 1}, which is")
            raise ValueError(f"{who}: {name}: {what} too many for 32-bit indexing (< 2**31)")
    allowed = [dtype_of(d) for d in dtypes]
    for name, t in named.items():
        if t.dtype not in allowed:
            raise ValueError(f"{who}: {name} has dtype {t.dtype}; this stage takes "
                             f"{', '.join(str(d) for d in allowed)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{who}: {name} has dtype {t.dtype} but q has {q.dtype}")
    for name, t in named.items():
        why = layout_problem(who, name, t, row_strides)
        if why:
            raise ValueError(why)
    for name, t in named.items():
        if t.device.type != "cuda":
            raise ValueError(f"{who}: {name} is on {t.device}; flashlab kernels need CUDA tensors "
                             f"(move them with .cuda())")
        if t.device != q.device:
            raise ValueError(f"{who}: {name} is on {t.device} but q is on {q.device}")
