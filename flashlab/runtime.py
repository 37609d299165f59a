"""What a stage needs of this machine: its GPU's compute capability, and the callable a built
stage is. flashlab.stages (the registry, plain data) reaches here when a Stage is built or asked
what it can run; nothing here imports the registry."""
import math

import torch

from . import build as _build
from .inputs import (DTYPE_CODES, DTYPE_NAMES, REMEMBERED, aligned, empty_in_order,
                     gradient_problem, reads_in_place, span, strides, validate)


def capability():
    """This machine's CUDA GPU's compute capability, (9, 0) say, or None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def build(stage, verbose=False) -> "Attention":
    """Compile `stage` (or load it from the cache) for this GPU: attn(q, k, v, causal=False,
    out=None, scale=None); a RuntimeError saying why where it cannot run here."""
    why = stage.unavailable(toolkit=False)
    if why is not None:
        raise RuntimeError(f"cannot build {stage.slug} here: {why}")
    arch = stage.arch(torch.cuda.get_device_capability())
    return Attention(stage, _build.build_module(stage.source, verbose=verbose, arch=arch))


# The current CUDA stream's handle as an int: torch's own raw getter where it has one (what
# Triton's launcher calls; it builds no torch.cuda.Stream object, which costs 3-6 us of host time
# on the H100's host), else the public way.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def refuse_autograd(who, q, k, v, out=None):
    """Raise ValueError where autograd would record this call to a stage without a backward pass:
    grad mode is on (the caller checks torch.is_grad_enabled(), which costs nothing) and q, k, v
    or out requires grad. A stage's kernel writes o through a raw pointer, so torch would hand
    back an output cut off from the graph, and a model trained through it would get no gradient
    through attention."""
    named = {"q": q, "k": k, "v": v, "out": out}
    wants = [n for n, t in named.items() if getattr(t, "requires_grad", False)]
    if wants:
        raise ValueError(
            f"{who}: {', '.join(wants)} {'requires' if len(wants) == 1 else 'require'} grad, and "
            "this stage has no backward pass: its output would carry no gradient. For inference, "
            "call it under torch.no_grad() or torch.inference_mode() (or pass detached tensors); "
            "to train, use a stage with a backward pass (`flashlab list` marks them) or "
            "torch.nn.functional.scaled_dot_product_attention")


def _wants_grad(*tensors) -> bool:
    return any(getattr(t, "requires_grad", False) for t in tensors)


class _Recorded(torch.autograd.Function):
    """A stage with a backward pass as autograd sees it: the forward saves q, k, v, o and the
    log-sum-exp; backward() runs the stage's backward kernels. The lse output carries no
    gradient (mark_non_differentiable): it is returned for those who asked for it."""

    @staticmethod
    def forward(ctx, attn, q, k, v, causal, scale):
        o, lse = attn._forward(q, k, v, causal, None, scale, True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.attn, ctx.causal, ctx.scale = attn, causal, scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ctx.attn.backward(q, k, v, o, lse, do, ctx.causal, scale=ctx.scale)
        return None, dq, dk, dv, None, None


class Attention:
    """A built stage: attn(q, k, v, causal=False, out=None, scale=None, return_lse=False) -> o,
    all (B, H, N, D); a stage with a backward pass also has backward()."""

    def __init__(self, stage, module):
        self.stage = stage
        self.module = module
        # (B, H, N, D, dtype, causal, device) -> (dtype code, workspace bytes) of a problem this
        # stage took: what the registry and the kernel file said of it, asked once per problem
        self._plans = {}

    def __repr__(self):
        return f"<flashlab attention {self.stage.slug}>"

    def _plan(self, q, causal):
        """(dtype code, workspace bytes) for q's problem, or a ValueError saying why not."""
        st = self.stage
        if DTYPE_NAMES[q.dtype] in st.dtype_min_cc:  # bf16 on a T4, say: refused, never run
            why = st.unavailable(torch.cuda.get_device_capability(q.device), toolkit=False,
                                 dtype=DTYPE_NAMES[q.dtype])
            if why is not None:
                raise ValueError(why)
        if causal and not st.causal:
            raise ValueError(f"{st.slug}: causal attention is not supported by this stage")
        B, H, N, D = q.shape
        code = DTYPE_CODES[q.dtype]
        why = self.module.unsupported(B, H, N, D, code, causal)
        if why is not None:
            raise ValueError(f"{st.slug}: {why}")
        return code, self.module.workspace_bytes(B, H, N, D, code, causal)

    def __call__(self, q, k, v, causal=False, out=None, scale=None, return_lse=False):
        """o, or (o, lse) with return_lse=True: lse (B, H, N) fp32, each query row's
        log-sum-exp of its scaled scores, natural log (stages whose registry entry has lse).
        Where autograd records the call (grad mode on, an input requiring grad), a stage with a
        backward pass returns an o that carries gradients to q, k and v; any other refuses."""
        st = self.stage
        if return_lse and not st.lse:
            raise ValueError(f"{st.slug}: return_lse=True, but this stage's forward does not write "
                             "the log-sum-exp (its registry entry has no lse)")
        if torch.is_grad_enabled() and _wants_grad(q, k, v, out):  # never a silent detach
            if not st.has_backward:
                refuse_autograd(st.slug, q, k, v, out)
            if out is not None:
                raise ValueError(f"{st.slug}: out= cannot be used while autograd records the call "
                                 "(the output must be a new tensor of the graph): leave out=None")
            validate(st.slug, q, k, v, st.dtypes, None, row_strides=st.row_strides)
            o, lse = _Recorded.apply(self, q, k, v, bool(causal), scale)
            return (o, lse) if return_lse else o
        out, lse = self._forward(q, k, v, causal, out, scale, return_lse)
        return (out, lse) if return_lse else out

    def _scale(self, D, scale):
        scale = D ** -0.5 if scale is None else float(scale)
        if not (0 < scale < math.inf):  # stage 08 folds it into exp2 after taking the row max
            raise ValueError(f"{self.stage.slug}: scale must be a positive finite number, got {scale}")
        return scale

    def _problem(self, q, causal):
        B, H, N, D = q.shape
        problem = (B, H, N, D, q.dtype, causal, q.device)
        plan = self._plans.get(problem)
        if plan is None:
            plan = self._plan(q, causal)
            if len(self._plans) >= REMEMBERED:
                self._plans.clear()
            self._plans[problem] = plan
        return plan

    def _forward(self, q, k, v, causal, out, scale, with_lse):
        """(o, lse or None): the stage's forward, the log-sum-exp written where with_lse."""
        st = self.stage
        validate(st.slug, q, k, v, st.dtypes, out, row_strides=st.row_strides)
        causal = bool(causal)
        B, H, N, D = q.shape
        code, ws_bytes = self._problem(q, causal)
        scale = self._scale(D, scale)
        out = torch.empty_like(q) if out is None else out
        lse = torch.empty(B, H, N, dtype=torch.float32, device=q.device) if with_lse else None
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
        layout = tuple(strides(t) for t in (q, k, v, out)) if st.row_strides else None
        if q.get_device() == torch.cuda.current_device():  # no device switch to pay for
            self._launch(q, k, v, out, ws, B, H, N, D, code, causal, scale, layout, lse)
        else:
            with torch.cuda.device(q.device):
                self._launch(q, k, v, out, ws, B, H, N, D, code, causal, scale, layout, lse)
        return out, lse

    def backward(self, q, k, v, o, lse, do, causal=False, dq=None, dk=None, dv=None, scale=None):
        """The stage's backward pass: (dq, dk, dv), the gradients of a loss L with dL/dO = do,
        for o = attn(q, k, v, causal, scale) and its lse (return_lse=True). dq, dk, dv, if given,
        are written (contiguous, the inputs' dtype, on a 16-byte boundary); else new tensors, laid
        out as q, k and v are where the stage writes any strides (registry: grad_strides;
        inputs.empty_in_order), else contiguous. q, k, v may be any view the forward reads; o is
        made contiguous and 16-byte aligned where it is not, and so is do unless the stage has
        grad_strides and reads it in place."""
        st = self.stage
        if not st.has_backward:
            raise ValueError(f"{st.slug} has no backward pass")
        validate(st.slug, q, k, v, st.dtypes, None, row_strides=st.row_strides)
        B, H, N, D = q.shape
        for name, t in (("o", o), ("do", do)):
            if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype \
                    or t.device != q.device:
                raise ValueError(f"{st.slug} backward: {name} must be a {q.dtype} tensor of shape "
                                 f"{tuple(q.shape)} on {q.device}")
        if (not isinstance(lse, torch.Tensor) or lse.shape != (B, H, N)
                or lse.dtype != torch.float32 or lse.device != q.device):
            raise ValueError(f"{st.slug} backward: lse must be a float32 tensor of shape "
                             f"{(B, H, N)} on {q.device} (the forward's return_lse=True)")
        grads = []
        for name, t, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
            if t is None:  # a stage with grad_strides writes each in its input's order
                t = (empty_in_order(like) if st.grad_strides
                     else torch.empty(B, H, N, D, dtype=q.dtype, device=q.device))
            elif (why := gradient_problem(st.slug, name, t, q)) is not None:
                raise ValueError(why)
            grads.append(t)
        causal = bool(causal)
        code, _ = self._problem(q, causal)
        scale = self._scale(D, scale)
        o, lse = aligned(o.contiguous()), lse.contiguous()
        if not (st.grad_strides and span(do) < 2**31
                and reads_in_place(st.slug, "do", do, row_strides=True)):
            do = aligned(do.contiguous())  # a stage with grad_strides reads a model's dO in place
        ws_bytes = self.module.backward_workspace_bytes(B, H, N, D, code, causal)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
        layout = tuple(strides(t) for t in (q, k, v, o)) if st.row_strides else None
        grad_layout = tuple(strides(t) for t in (*grads, do)) if st.grad_strides else None
        ptrs = [t.data_ptr() for t in (q, k, v, o, lse, do, *grads)]
        with torch.cuda.device(q.device):
            self.module.backward(*ptrs, ws.data_ptr() if ws is not None else 0, B, H, N, D, code,
                                 causal, scale, _current_stream(q.get_device()), layout,
                                 grad_layout)
        return tuple(grads)

    def _launch(self, q, k, v, out, ws, B, H, N, D, code, causal, scale, layout, lse=None):
        stream = _current_stream(q.get_device())
        self.module.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                           ws.data_ptr() if ws is not None else 0, B, H, N, D, code, causal,
                           scale, stream, layout, lse.data_ptr() if lse is not None else 0)


