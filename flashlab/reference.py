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


# --- the backward pass ---------------------------------------------------------------------------

def naive_backward(q, k, v, do, causal=False, scale=None):
    """(dq, dk, dv) of naive_attention in the inputs' own dtype, by autograd: PyTorch's own
    same-dtype backward, whose error against reference_backward sets a stage's tolerance."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        o = naive_attention(*leaves, causal=causal, scale=scale)
        return torch.autograd.grad(o, leaves, do.to(o.dtype))


def reference_backward(q, k, v, do, causal=False, scale=None, max_bytes=2**31):
    """(dq, dk, dv) in float64, one slice of heads at a time (as reference() takes the forward)."""
    B, H, N, D = q.shape
    grads = [torch.empty(B * H, N, D, dtype=torch.float64, device=q.device) for _ in range(3)]
    step = max(1, max_bytes // (3 * N * N * 8))
    flat = [t.reshape(B * H, N, D) for t in (q, k, v, do)]
    for i in range(0, B * H, step):
        sl = slice(i, i + step)
        got = naive_backward(*(t[sl].double() for t in flat), causal=causal, scale=scale)
        for g, part in zip(grads, got):
            g[sl] = part
    return tuple(g.view(B, H, N, D) for g in grads)


def reference_lse(q, k, causal=False, scale=None):
    """The row log-sum-exp of the scaled scores in float64, (B, H, N), natural log:
    lse_i = log sum_j exp(scale · q_i · k_j) over the keys row i attends to. What a forward stage
    saves for its backward: P = exp(scale · Q Kᵀ − lse) row by row, with no second pass for the
    maximum and the sum."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty(q.shape[:-1], dtype=torch.float64, device=q.device)
    B, H, N, D = q.shape
    qf, kf = q.reshape(B * H, N, D), k.reshape(B * H, N, D)
    of = out.view(B * H, N)
    for i in range(B * H):
        s = torch.matmul(qf[i].double(), kf[i].double().T) * scale
        if causal:
            s = s.masked_fill(_mask(N, q.device), float("-inf"))
        of[i] = torch.logsumexp(s, dim=-1)
    return out


def blocked_backward(q, k, v, o, lse, do, causal=False, scale=None, BR=64, BC=64):
    """FlashAttention-2's backward (its Algorithm 2), tile by tile in PyTorch, as a kernel runs it:
    a preprocessing pass takes Δ = rowsum(dO ∘ O); then, for each block of BC keys and values, each
    block of BR queries recomputes its scores and P = exp(S − lse) from Q, K and the forward's
    log-sum-exp, and adds dV += Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − Δ), dK += dSᵀ Q (scaled) into
    the key block's accumulators, and dQ += dS K (scaled) into an fp32 dQ shared by every key
    block (a kernel adds it with atomics, then converts it). Products in the inputs' dtype with
    fp32 accumulation, as the tensor cores take them. Returns (dq, dk, dv) in the inputs' dtype.
    A model of the algorithm for the notebooks and tests: slow, and exact to fp32 rounding."""
    B, H, N, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    f32 = torch.float32
    delta = (do.to(f32) * o.to(f32)).sum(-1)                        # (B, H, N), the preprocess
    dq = torch.zeros(B, H, N, D, dtype=f32, device=q.device)        # fp32, shared by key blocks
    dk = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
    dv = torch.empty(B, H, N, D, dtype=q.dtype, device=q.device)
    rows = torch.arange(N, device=q.device)
    for j in range(0, N, BC):                                       # one thread block's keys
        kj, vj = k[:, :, j:j + BC], v[:, :, j:j + BC]
        dkj = torch.zeros(B, H, kj.shape[2], D, dtype=f32, device=q.device)
        dvj = torch.zeros_like(dkj)
        first = j if causal else 0                                  # rows above the diagonal: none
        for i in range(first - first % BR, N, BR):
            qi, doi = q[:, :, i:i + BR], do[:, :, i:i + BR]
            s = torch.matmul(qi.to(f32), kj.to(f32).transpose(-2, -1)) * scale
            if causal:
                s = s.masked_fill(rows[j:j + BC][None, :] > rows[i:i + BR][:, None], float("-inf"))
            p = torch.exp(s - lse[:, :, i:i + BR, None].to(f32))    # P recomputed from the lse
            dvj += torch.matmul(p.to(q.dtype).to(f32).transpose(-2, -1), doi.to(f32))
            dp = torch.matmul(doi.to(f32), vj.to(f32).transpose(-2, -1))
            ds = p * (dp - delta[:, :, i:i + BR, None])
            dkj += torch.matmul(ds.to(q.dtype).to(f32).transpose(-2, -1), qi.to(f32)) * scale
            dq[:, :, i:i + BR] += torch.matmul(ds.to(q.dtype).to(f32), kj.to(f32)) * scale
        dk[:, :, j:j + BC], dv[:, :, j:j + BC] = dkj.to(q.dtype), dvj.to(q.dtype)
    return dq.to(q.dtype), dk, dv


def grad_err(out, ref, floor=0.0) -> float:
    """||out - ref|| / max(||ref||, floor): rel_err, except where the reference is (nearly) zero
    (dQ and dK when every row has one key: the softmax of one score has no gradient), where the
    difference is measured against `floor` (check_backward: a tenth of the largest of the
    three gradients' norms); inf when out holds NaN or inf."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    diff = torch.linalg.vector_norm(out - ref).item()
    norm = max(torch.linalg.vector_norm(ref).item(), floor)
    return diff / norm if norm > 0 else diff
