"""Reference attention: the float64 truth every stage is checked against, and the plain PyTorch
version (matmul, softmax, matmul in the input dtype) that the baselines include."""
import math

import torch


def _mask(n, device):
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)  # True above the diagonal


def naive_attention(q, k, v, causal=False, scale=None):
    """softmax(q k^T * scale) v in the inputs' own dtype, materialising the N x N scores."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_mask(q.shape[-2], q.device), float("-inf"))
    acc = torch.float64 if s.dtype == torch.float64 else torch.float32  # fp16/bf16: fp32 softmax
    return torch.matmul(torch.softmax(s.to(acc), dim=-1).to(q.dtype), v)


def reference(q, k, v, causal=False, scale=None, max_bytes=2**31):
    """Attention in float64, one slice of heads at a time so that N = 16k fits in memory."""
    B, H, N, D = q.shape
    out = torch.empty(B, H, N, D, dtype=torch.float64, device=q.device)
    per_head = N * N * 8
    step = max(1, max_bytes // per_head)
    qf, kf, vf = (t.reshape(B * H, N, D) for t in (q, k, v))
    of = out.view(B * H, N, D)
    for i in range(0, B * H, step):
        sl = slice(i, i + step)
        of[sl] = naive_attention(qf[sl].double(), kf[sl].double(), vf[sl].double(), causal, scale)
    return out


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds NaN or inf (e.g. unwritten poison)."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()
