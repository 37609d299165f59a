"""What a stage needs of this machine: its GPU's compute capability, and the callable a built
stage is. flashlab.stages (the registry, plain data) reaches here when a Stage is built or asked
what it can run; nothing here imports the registry."""
import math

import torch

from . import build as _build
from .inputs import DTYPE_CODES, DTYPE_NAMES, REMEMBERED, strides, validate


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
    """Raise ValueError where autograd would record this call: grad mode is on (the caller checks
    torch.is_grad_enabled(), which costs nothing) and q, k, v or out requires grad. A stage's
    kernel writes o through a raw pointer, so torch would hand back an output cut off from the
    graph, and a model trained through it would get no gradient through attention."""
    named = {"q": q, "k": k, "v": v, "out": out}
    wants = [n for n, t in named.items() if getattr(t, "requires_grad", False)]
    if wants:
        raise ValueError(
            f"{who}: {', '.join(wants)} {'requires' if len(wants) == 1 else 'require'} grad, and "
            "this stage has no backward pass: its output would carry no gradient. For inference, "
            "call it under torch.no_grad() or torch.inference_mode() (or pass detached tensors); "
            "to train, use torch.nn.functional.scaled_dot_product_attention")


class Attention:
    """A built stage: attn(q, k, v, causal=False, out=None, scale=None) -> o, all (B, H, N, D)."""

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

    def __call__(self, q, k, v, causal=False, out=None, scale=None):
        st = self.stage
        if torch.is_grad_enabled():  # never a silent detach: o would carry no gradient to q, k, v
            refuse_autograd(st.slug, q, k, v, out)
        validate(st.slug, q, k, v, st.dtypes, out, row_strides=st.row_strides)
        causal = bool(causal)
        B, H, N, D = q.shape
        problem = (B, H, N, D, q.dtype, causal, q.device)
        plan = self._plans.get(problem)
        if plan is None:
            plan = self._plan(q, causal)
            if len(self._plans) >= REMEMBERED:
                self._plans.clear()
            self._plans[problem] = plan
        code, ws_bytes = plan
        scale = D ** -0.5 if scale is None else float(scale)
        if not (0 < scale < math.inf):  # stage 08 folds it into exp2 after taking the row max
            raise ValueError(f"{st.slug}: scale must be a positive finite number, got {scale}")
        out = torch.empty_like(q) if out is None else out
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
        layout = tuple(strides(t) for t in (q, k, v, out)) if st.row_strides else None
        if q.get_device() == torch.cuda.current_device():  # no device switch to pay for
            self._launch(q, k, v, out, ws, B, H, N, D, code, causal, scale, layout)
        else:
            with torch.cuda.device(q.device):
                self._launch(q, k, v, out, ws, B, H, N, D, code, causal, scale, layout)
        return out

    def _launch(self, q, k, v, out, ws, B, H, N, D, code, causal, scale, layout):
        stream = _current_stream(q.get_device())
        self.module.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                           ws.data_ptr() if ws is not None else 0, B, H, N, D, code, causal,
                           scale, stream, layout)


