"""Correctness: compare an attention function with the float64 reference on fresh random inputs.

The output is poisoned with NaN before every call, so an element the kernel never writes makes
the error infinite. Shapes include N = 1, 17 and 1000, which no tile size divides, and a long
sequence (4096). A stage that reads strided rows (registry: row_strides) is also checked on the
layout a model hands it: q, k and v sliced from one (B, N, 3, H, D) projection and seen as
(B, H, N, D), rows 3·H·D elements apart, and the output written into a (B, N, H, D) tensor.
"""
import math
import os
from dataclasses import asdict, dataclass, field

import torch

from .inputs import DTYPE_NAMES, dtype_of
from .reference import (grad_err, naive_attention, naive_backward, reference, reference_backward,
                        reference_lse, rel_err)

# (B, H, N); each is run at every head dim the function supports, causal and not.
SHAPES = ((1, 1, 1), (2, 3, 17), (1, 2, 1000), (1, 1, 4096))
# (B, H, N) checked again in the model's layout, for stages that read strided rows (B, H > 1:
# a kernel that mixes up the batch, head or row strides reads the wrong rows).
STRIDED_SHAPES = ((2, 3, 17), (2, 4, 1000))
# (B, H, N) checked again with keys whose norm grows along the sequence (layout "growing"): every
# row's maximum keeps rising, so each tile takes the rescale path, and a pass that only checks
# for it (stage 13's lazy rescale) must take its fallback. Random inputs rarely do either.
GROWING_SHAPES = ((2, 3, 1000), (1, 2, 4096))
LAYOUTS = ("contiguous", "bnhd", "growing")
FP32_TOL = 1e-4
# check_backward: a gradient's error is relative to its own norm, or to a tenth of the
# largest of the three where it is smaller (dQ and dK are zero when every row has one key), and
# passes within twice PyTorch's own same-dtype error plus GRAD_EPS.
GRAD_FLOOR, GRAD_EPS = 0.1, 1e-4


@dataclass
class Case:
    B: int
    H: int
    N: int
    D: int
    causal: bool
    dtype: str
    rel_err: float
    tol: float
    layout: str = "contiguous"  # or "bnhd": see case_inputs()
    what: str = "o"             # the tensor compared: "o", or a gradient ("dq", "dk", "dv")

    @property
    def passed(self) -> bool:
        return self.rel_err <= self.tol  # False for NaN and inf


@dataclass
class CheckResult:
    name: str
    cases: list = field(default_factory=list)
    seed: int = 0

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def max_rel_err(self) -> float:
        return max((c.rel_err for c in self.cases), default=math.nan)

    def failures(self):
        return [c for c in self.cases if not c.passed]

    def rows(self):
        return [dict(asdict(c), passed=c.passed) for c in self.cases]

    def __str__(self):
        head = f"{self.name}: {'PASS' if self.passed else 'FAIL'} — {len(self.cases)} cases, " \
               f"max relative error {self.max_rel_err:.2e} (seed {self.seed})"
        lines = [head]
        for c in self.cases:
            mark = "ok  " if c.passed else "FAIL"
            where = "" if c.layout == "contiguous" else f"  {c.layout}"
            where += "" if c.what == "o" else f"  {c.what}"
            lines.append(f"  {mark} B={c.B} H={c.H} N={c.N:<5} D={c.D:<3} {c.dtype} "
                         f"causal={str(c.causal):5}  rel_err={c.rel_err:.2e}  tol={c.tol:.1e}"
                         f"{where}")
        return "\n".join(lines)

    _repr_pretty_ = lambda self, p, cycle: p.text(str(self))  # noqa: E731  (notebook display)


def tolerance(q, k, v, causal, ref) -> float:
    """fp32: 1e-4 relative. fp16/bf16: the FlashAttention tests' rule — at most twice the error of
    PyTorch's own attention computed in the same dtype (plus a hair, so an exact match passes)."""
    if q.dtype == torch.float32:
        return FP32_TOL
    return 2 * rel_err(naive_attention(q, k, v, causal), ref) + 1e-6


def case_inputs(B, H, N, D, dtype, layout="contiguous", gen=None, device="cuda"):
    """Random q, k, v and a NaN-poisoned output, (B, H, N, D) each. layout "contiguous": four
    contiguous tensors. "bnhd": what a transformer passes: q, k, v are (B, H, N, D) views of one
    (B, N, 3, H, D) projection (rows 3·H·D elements apart, heads D apart), and the output is the
    (B, H, N, D) view of a (B, N, H, D) tensor. "growing": contiguous, with key n scaled by
    1 + g n / N (g = 8 up to N = 1024, else 30): scores, and so each row's maximum, keep growing
    along the keys."""
    if layout == "growing":
        q, k, v, out = case_inputs(B, H, N, D, dtype, "contiguous", gen, device)
        growth = 8.0 if N <= 1024 else 30.0
        scale = 1 + growth * torch.arange(N, device=device, dtype=torch.float32) / N
        return q, (k.float() * scale[:, None]).to(dtype), v, out
    if layout == "contiguous":
        q, k, v = (torch.randn(B, H, N, D, generator=gen, device=device, dtype=dtype)
                   for _ in range(3))
        return q, k, v, torch.full_like(q, math.nan)
    if layout != "bnhd":
        raise ValueError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    qkv = torch.randn(B, N, 3, H, D, generator=gen, device=device, dtype=dtype)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = torch.full((B, N, H, D), math.nan, device=device, dtype=dtype).transpose(1, 2)
    return q, k, v, out


def _started(name, seed, device):
    """(a generator, an empty CheckResult) for one check: a fresh seed each call (without touching
    torch's global generator), kept in the result so that a failure can be replayed with
    check(..., seed=result.seed)."""
    seed = int.from_bytes(os.urandom(7), "little") if seed is None else seed
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen, CheckResult(name, seed=seed)


def _cases(dtypes, shapes, head_dims, causal, strided_shapes=(), growing_shapes=()):
    """The cases of a check, in its order: for each torch dtype of `dtypes`, each shape of
    `shapes` (layout "contiguous"), then of `strided_shapes` ("bnhd") and `growing_shapes`
    ("growing"), at every head dim, each causal flag; as (dtype, B, H, N, D, causal, layout).
    The shapes are read here, once; dtypes, head dims and causal flags as the cases are drawn."""
    runs = ([(shape, "contiguous") for shape in shapes] + [(shape, "bnhd") for shape in strided_shapes]
            + [(shape, "growing") for shape in growing_shapes])
    return ((dt, B, H, N, D, c, layout) for dt in dtypes for (B, H, N), layout in runs
            for D in head_dims for c in causal)


def check(attn, dtype=None, head_dims=None, shapes=SHAPES, causal=(False, True), seed=None,
          device="cuda", name=None, strided_shapes=None, growing_shapes=()) -> CheckResult:
    """Run `attn` on fresh random inputs over `shapes` x head dims x causal; see CheckResult.
    growing_shapes: shapes checked again with keys that grow along the sequence (GROWING_SHAPES
    exercises every rescale and fallback path; case_inputs' "growing" layout).

    For a built stage, dtype / head dims / causal default to what the stage supports (its dtypes
    this GPU runs: stage 04 on a T4 is checked in fp16 only, since its bf16 needs 8.0)."""
    st = getattr(attn, "stage", None)
    name = name or (st.slug if st else getattr(attn, "__name__", repr(attn)))
    if dtype is not None:
        dtypes = [dtype]
    elif st is not None and torch.device(device).type == "cuda":
        dtypes = list(st.dtypes_on(torch.cuda.get_device_capability(device)))
    elif st is not None:
        dtypes = list(st.dtypes)
    else:
        dtypes = ["fp32"]
    head_dims = head_dims or (st.head_dims if st else (64,))
    if strided_shapes is None:
        strided_shapes = STRIDED_SHAPES if getattr(st, "row_strides", False) else ()
    if st is not None and not st.causal:
        causal = (False,)
    cases = _cases(map(dtype_of, dtypes), shapes, head_dims, causal, strided_shapes, growing_shapes)
    gen, result = _started(name, seed, device)
    for dt, B, H, N, D, c, layout in cases:
        q, k, v, out = case_inputs(B, H, N, D, dt, layout, gen, device)
        got = attn(q, k, v, causal=c, out=out)
        if layout == "bnhd":
            got = out  # the output must land in the (B, N, H, D) tensor given
        ref = reference(q, k, v, causal=c)
        result.cases.append(Case(B, H, N, D, c, DTYPE_NAMES[dt], rel_err(got, ref),
                                 tolerance(q, k, v, c, ref), layout))
    return result


# --- the backward pass ---------------------------------------------------------------------------

def check_backward(backward, dtype="fp16", head_dims=(64, 128), shapes=SHAPES, causal=(False, True),
                   seed=None, device="cuda", name=None, strided_shapes=()) -> CheckResult:
    """Check a backward pass against float64 on fresh random inputs, as check() takes a forward.
    `backward(q, k, v, o, lse, do, causal, dq, dk, dv)` writes the gradients of the loss
    sum(o ∘ do) into dq, dk and dv, which are filled with NaN before every call (an element never
    written fails). It gets o in the inputs' dtype and lse (fp32, (B, H, N), natural log) from the
    float64 reference, so only the backward is judged. Each of dq, dk, dv passes within
    FlashAttention's rule: at most twice the error of PyTorch's own backward in the same dtype
    (plus a hair); fp32 within 1e-4. The cases say which gradient (Case.what). strided_shapes:
    shapes checked again with q, k and v the (B, H, N, D) views of one (B, N, 3, H, D)
    projection (case_inputs' "bnhd"), as a model hands them over. A built stage with a backward
    pass may be given as it is (its backward() is called)."""
    if getattr(getattr(backward, "stage", None), "has_backward", False):
        name = name or backward.stage.slug
        backward = backward.backward
    gen, result = _started(name or getattr(backward, "__name__", repr(backward)), seed, device)
    cases = _cases((dtype_of(dtype),), shapes, head_dims, causal, strided_shapes)
    for dt, B, H, N, D, c, layout in cases:
        q, k, v, _ = case_inputs(B, H, N, D, dt, layout, gen, device)
        do = torch.randn(B, H, N, D, generator=gen, device=device, dtype=dt)
        o = reference(q, k, v, causal=c).to(dt)
        lse = reference_lse(q, k, causal=c).float()
        grads = [torch.full(q.shape, math.nan, dtype=dt, device=device) for _ in range(3)]
        backward(q, k, v, o, lse, do, c, *grads)
        _judge_grads(result, q, k, v, do, c, grads, layout)
    return result


# (B, H, N) of check_repeatable: 64 key blocks of 64 adding into each row of dQ, and more blocks
# than an H100 holds at once, so that blocks of one head meet at the same sums.
REPEAT_SHAPES = ((2, 3, 4096),)


def check_repeatable(backward, dtype="fp16", head_dims=(64, 128), shapes=REPEAT_SHAPES,
                     causal=(False, True), runs=3, seed=None, device="cuda",
                     name=None) -> CheckResult:
    """Check that a backward gives the same bits every time: on fresh random inputs it runs
    `runs` times (the gradients poisoned with NaN before each), and every later run's dq, dk and
    dv must equal the first's bit for bit. A case's rel_err is the largest difference from the
    first run relative to the first run's largest magnitude (NaN where a run left NaN), its
    tolerance 0; its layout is "repeat". Takes a backward as check_backward does."""
    if getattr(getattr(backward, "stage", None), "has_backward", False):
        name = name or backward.stage.slug
        backward = backward.backward
    gen, result = _started(name or getattr(backward, "__name__", repr(backward)), seed, device)
    for dt, B, H, N, D, c, _ in _cases((dtype_of(dtype),), shapes, head_dims, causal):
        q, k, v, _ = case_inputs(B, H, N, D, dt, "contiguous", gen, device)
        do = torch.randn(B, H, N, D, generator=gen, device=device, dtype=dt)
        o = reference(q, k, v, causal=c).to(dt)
        lse = reference_lse(q, k, causal=c).float()
        first = None
        worst = {"dq": 0.0, "dk": 0.0, "dv": 0.0}
        for _ in range(runs):
            grads = [torch.full(q.shape, math.nan, dtype=dt, device=device) for _ in range(3)]
            backward(q, k, v, o, lse, do, c, *grads)
            if first is None:
                first = grads
                continue
            for what, got, ref in zip(("dq", "dk", "dv"), grads, first):
                same = torch.equal(got.view(torch.int16), ref.view(torch.int16))
                if not same:
                    scale = ref.float().abs().max().item() or 1.0
                    diff = (got.float() - ref.float()).abs().max().item() / scale
                    worst[what] = max(worst[what], diff) if not math.isnan(diff) else math.nan
                    worst[what] = worst[what] or math.ulp(1.0)  # differing bits, never 0
        for what, err in worst.items():
            result.cases.append(Case(B, H, N, D, c, DTYPE_NAMES[dt], err, 0.0, "repeat", what=what))
    return result


def promised_checks(st) -> list:
    """What a stage promises beyond its forward, as checks: its log-sum-exp (check_lse, where
    st.lse), its gradients (check_backward, where it has a backward) and the same bits on every
    run (check_repeatable, where st.deterministic). Each is called (attn, dtype=..., ...)."""
    return [c for c, has in ((check_lse, st.lse), (check_backward, st.has_backward),
                             (check_repeatable, st.deterministic)) if has]


def _judge_grads(result, q, k, v, do, causal, grads, layout="contiguous"):
    """Add the cases of dq, dk and dv (`grads`) against float64 to `result`."""
    B, H, N, D = q.shape
    refs = reference_backward(q, k, v, do, causal=causal)
    theirs = naive_backward(q, k, v, do, causal=causal) if q.dtype != torch.float32 else None
    floor = GRAD_FLOOR * max(torch.linalg.vector_norm(r).item() for r in refs)
    for what, got, ref, i in zip(("dq", "dk", "dv"), grads, refs, range(3)):
        tol = FP32_TOL if theirs is None else 2 * grad_err(theirs[i], ref, floor) + GRAD_EPS
        result.cases.append(Case(B, H, N, D, causal, DTYPE_NAMES[q.dtype],
                                 grad_err(got, ref, floor), tol, layout, what=what))


def check_training(attn, dtype="fp16", head_dims=(64, 128), shapes=SHAPES, causal=(False, True),
                   seed=None, device="cuda", name=None, strided_shapes=STRIDED_SHAPES) -> CheckResult:
    """A stage as a model trains through it: q, k, v require grad, o = attn(q, k, v) is taken
    with autograd recording, and o.backward(do) must fill q.grad, k.grad and v.grad with the
    float64 gradients (FlashAttention's rule, as check_backward). o is checked as check() does,
    so the forward that saved the log-sum-exp is judged too. strided_shapes: again with q, k, v
    views of one (B, N, 3, H, D) projection that requires grad (its .grad is checked)."""
    st = getattr(attn, "stage", None)
    gen, result = _started(name or (st.slug if st else repr(attn)), seed, device)
    cases = _cases((dtype_of(dtype),), shapes, head_dims, causal, strided_shapes)
    for dt, B, H, N, D, c, layout in cases:
        q, k, v, _ = case_inputs(B, H, N, D, dt, layout, gen, device)
        do = torch.randn(B, H, N, D, generator=gen, device=device, dtype=dt)
        if layout == "bnhd":  # the projection is the leaf, as in a model
            qkv = torch.stack([t.transpose(1, 2) for t in (q, k, v)], dim=2)
            qkv.requires_grad_(True)                      # (B, N, 3, H, D)
            leaves = [qkv[:, :, i].transpose(1, 2) for i in range(3)]
        else:
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            o = attn(*leaves, causal=c)
            if not o.requires_grad:
                raise AssertionError(f"{result.name}: the output carries no gradient")
            o.backward(do)
        ref = reference(q, k, v, causal=c)
        result.cases.append(Case(B, H, N, D, c, DTYPE_NAMES[dt], rel_err(o.detach(), ref),
                                 tolerance(q, k, v, c, ref), layout))
        if layout == "bnhd":
            grads = [qkv.grad[:, :, i].transpose(1, 2) for i in range(3)]
        else:
            grads = [t.grad for t in leaves]
        _judge_grads(result, q, k, v, do, c, grads, layout)
    return result


def _poison_next(shape, device):
    """The lse a forward returns is a tensor it allocates, so the check cannot fill it first. On a
    GPU, PyTorch's caching allocator gives the next allocation of a size the block of that size
    freed last: a block of `shape` fp32 is filled with NaN and freed here, so that a row the kernel
    never writes reads NaN rather than what an earlier call left. Its address (None off a GPU)."""
    if torch.device(device).type != "cuda":
        return None
    block = torch.full(shape, math.nan, dtype=torch.float32, device=device)
    return block.data_ptr()  # freed on return: back in the allocator's cache, still NaN


def check_lse(attn, dtype="fp16", head_dims=(64, 128), shapes=SHAPES, causal=(False, True),
              seed=None, device="cuda", name=None, tol=1e-4) -> CheckResult:
    """Check the row log-sum-exp a forward returns (attn(q, k, v, causal=c, return_lse=True) ->
    (o, lse)) against float64: relative error of lse within `tol` (it is a sum of exponentials
    taken in fp32 from the inputs as given), with the output poisoned as check() does, and the
    lse too, where it is a new tensor on a GPU (_poison_next)."""
    gen, result = _started(name or getattr(attn, "__name__", repr(attn)), seed, device)
    for dt, B, H, N, D, c, layout in _cases((dtype_of(dtype),), shapes, head_dims, causal):
        q, k, v, out = case_inputs(B, H, N, D, dt, layout, gen, device)
        poisoned = _poison_next((B, H, N), device)
        _, lse = attn(q, k, v, causal=c, out=out, return_lse=True)
        if poisoned is not None and lse.data_ptr() != poisoned:
            raise RuntimeError(f"check_lse: the lse of {(B, H, N, D)} was not allocated where "
                               "the poisoned block was; a row left unwritten might not show")
        result.cases.append(Case(B, H, N, D, c, DTYPE_NAMES[dt],
                                 rel_err(lse, reference_lse(q, k, causal=c)), tol, layout,
                                 what="lse"))
    return result
