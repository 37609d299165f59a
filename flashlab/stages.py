"""The stages of the workbook, in order, and the callable that each one builds."""
import math
from dataclasses import dataclass

import torch

from . import build as _build
from .inputs import DTYPE_CODES, validate
from .paths import KERNELS


@dataclass(frozen=True)
class Stage:
    number: int
    slug: str              # e.g. "03_coarsened": the .cu file, the notebook and the results rows
    title: str
    idea: str              # the one technique this stage adds
    dtypes: tuple          # input dtypes it takes: "fp32", "fp16", "bf16"
    head_dims: tuple       # head dims it is checked and timed at
    any_head_dim: bool     # True: every D that fits in shared memory also works
    causal: bool = True    # supports causal masking
    fast: bool = False     # worth timing over the FlashAttention paper's sweep

    @property
    def name(self) -> str:
        return self.slug

    @property
    def source(self):
        return KERNELS / f"{self.slug}.cu"

    def build(self, verbose=False) -> "Attention":
        """Compile (or load from cache) and return attn(q, k, v, causal=False, out=None)."""
        return Attention(self, _build.build_module(self.source, verbose=verbose))

    def __str__(self):
        return f"{self.slug}: {self.title}"


class Attention:
    """A built stage: attn(q, k, v, causal=False, out=None, scale=None) -> o, all (B, H, N, D)."""

    def __init__(self, stage: Stage, module):
        self.stage = stage
        self.module = module

    def __repr__(self):
        return f"<flashlab attention {self.stage.slug}>"

    def __call__(self, q, k, v, causal=False, out=None, scale=None):
        st = self.stage
        validate(st.slug, q, k, v, st.dtypes, out)
        if causal and not st.causal:
            raise ValueError(f"{st.slug}: causal attention is not supported by this stage")
        B, H, N, D = q.shape
        code = DTYPE_CODES[q.dtype]
        why = self.module.unsupported(B, H, N, D, code, bool(causal))
        if why is not None:
            raise ValueError(f"{st.slug}: {why}")
        scale = D ** -0.5 if scale is None else float(scale)
        if not (0 < scale < math.inf):  # stage 08 folds it into exp2 after taking the row max
            raise ValueError(f"{st.slug}: scale must be a positive finite number, got {scale}")
        out = torch.empty_like(q) if out is None else out
        ws_bytes = self.module.workspace_bytes(B, H, N, D, code, bool(causal))
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=q.device) if ws_bytes else None
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            self.module.launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                               ws.data_ptr() if ws is not None else 0, B, H, N, D, code,
                               bool(causal), scale, stream)
        return out


_STAGES = (
    Stage(1, "01_naive", "Naive (flash-attention-minimal)",
          "FlashAttention-1 loop order, one thread per query row, m and l in global memory",
          ("fp32",), (64, 128), any_head_dim=True),
    Stage(2, "02_coalesced", "Coalesced loads",
          "2-D thread blocks: a warp owns a row, reads 32 consecutive floats, splits the row's work",
          ("fp32",), (64, 128), any_head_dim=True),
    Stage(3, "03_coarsened", "Thread coarsening",
          "query tiles outer, m/l/O in registers, each thread a 4x4 patch, padded shared memory",
          ("fp32",), (64, 128), any_head_dim=False),
    Stage(4, "04_wmma", "WMMA tensor cores",
          "QKᵀ and PV on tensor cores as 16x16x16 WMMA fragments, fp32 accumulate; S, P, O via "
          "shared memory",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True),
    Stage(5, "05_mma", "mma.sync + ldmatrix (FlashAttention-2 split)",
          "PTX mma.sync with published fragment layouts: Q, S, P and O live in registers, "
          "softmax by quad shuffles, ldmatrix(.trans) for K and V",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True),
    Stage(6, "06_swizzle", "Swizzled shared memory",
          "dense tiles with the 16-byte chunks of row r XOR-permuted by r % 8: conflict-free "
          "ldmatrix without padding",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True),
    Stage(7, "07_cp_async", "cp.async pipeline",
          "K/V tiles copied global -> shared with cp.async into 2 buffers: the next tile loads "
          "while this one is computed",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True),
    Stage(8, "08_tuned", "Tuned",
          "tile shape, warps, rows per warp, pipeline depth and five small changes picked per head "
          "dim, mask and range of N by an autotune on the GPU",
          ("fp16", "bf16"), (64, 128), any_head_dim=False, fast=True),
)


def stages():
    """All stages, in order."""
    return list(_STAGES)


def stage(key) -> Stage:
    """A stage by number (3), number string ('03', '3') or slug ('03_coarsened'); a Stage
    passes through."""
    if isinstance(key, Stage):
        return key
    for st in _STAGES:
        if key == st.number or key == st.slug or (isinstance(key, str) and key.isdigit()
                                                  and int(key) == st.number):
            return st
    known = ", ".join(st.slug for st in _STAGES)
    raise ValueError(f"no stage {key!r}; the stages are {known}")
