"""Ring attention (context parallelism) on torch.distributed: a sequence split across the ranks
of a process group, each rank's queries meeting every rank's keys and values as the K/V blocks
travel around the ring, the partial outputs merged from their log-sum-exps.

Each rank holds a shard of q, k and v, (B, H, n, D) with n = N / world (a length the split does
not divide is padded at its end, and ring_attention told the real length). A step computes the local
attention of the rank's queries against the K/V block it holds, (o_s, lse_s), while the block is
already on its way to the next rank (point-to-point sends and receives, `dist.batch_isend_irecv`);
the partial outputs merge in fp32:

    lse = log(e^lse_a + e^lse_b),   o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b.

Causal attention is split zig-zag: the sequence in 2·world chunks, rank r holding chunks r and
2·world - 1 - r, so that every rank has as many unmasked scores as every other (a contiguous
split would leave rank 0 one block of work and the last rank `world`). The backward runs the same
ring: each rank adds its queries' dQ, and dK and dV travel with their K/V block, back to the rank
that owns it after a last hop. It needs only the merged o and lse: a block's part of the gradient
is FlashAttention-2's, P = exp(S - lse) with the global lse and Δ = rowsum(dO ∘ O) with the global O.

The local attention is a `Local`: a flashlab stage with a log-sum-exp (05 on; 14 on for the
backward) (`stage_local`), or the float64 reference (`reference_local`), which lets the ring and the
merge be checked on CPUs with the gloo backend (`check`). Stages take queries and keys of one
length, so a zig-zag step that pairs one chunk with another runs a chunk-sized problem a pair, on
views of the shard's halves.
"""
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .reference import _mask


@dataclass
class Local:
    """The attention a rank runs on its block. forward(q, k, v, causal, scale) -> (o, lse fp32);
    backward(q, k, v, o, lse, do, causal, scale) -> (dq, dk, dv): the block's share of the
    gradients, P recomputed from the given (global) lse, Δ from the given (global) o."""
    name: str
    forward: Callable
    backward: Callable


def _ref_forward(q, k, v, causal, scale):
    s = torch.matmul(q.double(), k.double().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_mask(q.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.double()).to(q.dtype), lse


def _ref_backward(q, k, v, o, lse, do, causal, scale):
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    s = torch.matmul(q64, k64.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_mask(q.shape[-2], q.device), float("-inf"))
    p = torch.exp(s - lse.double()[..., None])
    delta = (do64 * o.double()).sum(-1, keepdim=True)
    ds = p * (torch.matmul(do64, v64.transpose(-2, -1)) - delta)
    return (torch.matmul(ds, k64).mul_(scale).to(q.dtype),
            torch.matmul(ds.transpose(-2, -1), q64).mul_(scale).to(q.dtype),
            torch.matmul(p.transpose(-2, -1), do64).to(q.dtype))


def reference_local() -> Local:
    """Float64 attention as a rank's local attention: what the CPU tests run the ring with."""
    return Local("reference", _ref_forward, _ref_backward)


def stage_local(attn) -> Local:
    """A built stage (flashlab.build(...)) as a rank's local attention: its forward with
    return_lse=True (stage 05 on) and, where the stage has one, its backward pass (stage 14 on;
    without one, the ring's backward raises a ValueError saying so)."""
    st = attn.stage
    if not st.lse:
        raise ValueError(f"{st.slug}: ring attention merges the blocks' outputs by their "
                         "log-sum-exps, which this stage's forward does not write (stage 05 on)")

    def dense(*ts):  # the ring's halves are views: a stage that reads no strides gets copies
        return ts if st.row_strides else tuple(t.contiguous() for t in ts)

    def forward(q, k, v, causal, scale):
        with torch.no_grad():
            return attn(*dense(q, k, v), causal=causal, scale=scale, return_lse=True)

    def backward(q, k, v, o, lse, do, causal, scale):
        if not st.has_backward:
            raise ValueError(f"{st.slug} has no backward pass: train through a ring with a stage "
                             "that has one (14 on)")
        return attn.backward(*dense(q, k, v), o, lse.float(), do, causal=causal, scale=scale)

    return Local(st.slug, forward, backward)


def merge(o_a, lse_a, o_b, lse_b):
    """(o, lse) of the union of two disjoint sets of keys from each part's (o, lse): in fp32
    (float64 stays float64). A row with no keys in a part has lse -inf there and weight 0."""
    acc = torch.float64 if o_a.dtype == torch.float64 else torch.float32
    o, lse = o_a.to(acc, copy=True), lse_a.to(acc, copy=True)
    merge_into(o, lse, o_b, lse_b)
    return o, lse


def merge_into(o, lse, o_s, lse_s):
    """merge(), in place: (o, lse) becomes the union of its keys and (o_s, lse_s)'s. o and lse
    are the running fp32 (or float64) sums, views allowed (a chunk of a shard's rows); o_s may
    be fp16 or bf16. The per-row weights are small; o is read and written twice, o_s read once
    (the ring merges every step, and at short lengths the merge's bytes are a step's cost)."""
    lse_s = lse_s.to(lse.dtype)
    m = torch.maximum(lse, lse_s)
    m_safe = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse - m_safe), torch.exp(lse_s - m_safe)
    total = wa + wb
    inv = torch.where(total > 0, 1 / total, torch.zeros_like(total))
    o.mul_((wa * inv)[..., None]).addcmul_(o_s, (wb * inv)[..., None])
    lse.copy_(torch.where(total > 0, m_safe + torch.log(total), torch.full_like(m, -math.inf)))


# --- the split ------------------------------------------------------------------------------------

def _split(N, world, causal):
    """The chunk length c of a sequence of N split over `world` ranks (world chunks, or 2·world
    zig-zag), the sequence padded at its end to a whole number of chunks."""
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"ring attention needs a whole number of ranks, at least 1, got {world!r}")
    parts = 2 * world if causal else world
    if N < parts:
        raise ValueError(f"ring attention over {world} ranks splits the sequence into {parts} "
                         f"chunks{' (zig-zag, for causal balance)' if causal else ''}: N = {N} is "
                         f"shorter than that")
    return -(-N // parts)


def chunk_owner(chunk, world, causal=True):
    """The rank that holds chunk `chunk` of the sequence: of 2·world chunks under the zig-zag
    split (causal: rank r holds chunks r and 2·world - 1 - r), of world contiguous ones without
    the mask (rank r holds chunk r)."""
    parts = 2 * world if causal else world
    if not 0 <= chunk < parts:
        raise ValueError(f"chunk {chunk!r}: {world} ranks hold chunks 0 to {parts - 1}")
    return chunk if chunk < world else parts - 1 - chunk


def shard(x, world, rank, causal, dim=2):
    """Rank `rank`'s part of a full-sequence tensor (the sequence along `dim`): a contiguous
    n = ⌈N/world⌉ rows, or zig-zag for causal, chunks rank and 2·world - 1 - rank of 2·world.
    A length the chunks do not divide is padded with zeros at its end; ring_attention is told
    the real length, and a causal mask or the key count keeps the padding out of every real row."""
    N = x.shape[dim]
    c = _split(N, world, causal)
    pad = c * (2 * world if causal else world) - N
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:dim], pad, *x.shape[dim + 1:])], dim=dim)
    mine = [i for i in range(2 * world if causal else world) if chunk_owner(i, world, causal) == rank]
    return torch.cat([x.narrow(dim, i * c, c) for i in mine], dim=dim).contiguous()


def unshard(parts, causal, dim=2, length=None):
    """The full-sequence tensor from every rank's shard (a list in rank order): shard's inverse,
    cut back to `length` rows where shard padded."""
    if not causal:
        whole = torch.cat(parts, dim=dim)
    else:
        halves = [p.chunk(2, dim=dim) for p in parts]
        whole = torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)
    return whole if length is None else whole.narrow(dim, 0, length)


def _keys_in(src, n, length, causal):
    """How many of src's n keys are real, where the padding needs telling apart: without the mask
    only (a causal mask already hides the padding, which comes after every real row), else None."""
    if causal or length is None or (src + 1) * n <= length:
        return None
    return max(0, min(n, length - src * n))


def _windows(n, m):
    """(start, first, end) of ⌈n/m⌉ windows of m rows covering n rows: window i starts at `start`
    and owns rows [first, end), so that each row is owned once."""
    return [(min(i * m, n - m), i * m, min((i + 1) * m, n)) for i in range(-(-n // m))]


# --- the ring -------------------------------------------------------------------------------------

def _peers(group):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    to_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    return world, rank, to_global((rank + 1) % world), to_global((rank - 1) % world)


class _Pass:
    """Send tensors to the next rank and receive the previous rank's, started now, waited on by
    wait(): the communication of one ring step, overlapped with the step's local attention."""

    def __init__(self, tensors, group):
        world, _, nxt, prv = _peers(group)
        self.recv = [torch.empty_like(t) for t in tensors]
        if world == 1:
            self.recv, self.works = list(tensors), []
            return
        ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, group) for r in self.recv]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self):
        for w in self.works:
            w.wait()
        return self.recv


def _step_plan(rank, src, world, causal):
    """Which (query half, key half) pairs rank `rank` computes against the block of rank `src`,
    as (pairs, causal): halves 0 and 1 are a zig-zag shard's two chunks, None the whole shard."""
    if not causal:
        return [(None, None)], False
    if src == rank:
        return [(None, None)], True   # the two chunks in order: the local causal mask is exact
    if src < rank:
        return [(0, 0), (1, 0)], False  # the block's first chunk precedes both of ours
    return [(1, 0), (1, 1)], False      # both of its chunks precede our second only


def _half(x, h):
    """Half h (0 or 1) of a zig-zag shard along the sequence (dim 2, also of a (B, H, n) lse): a
    view; x itself for None."""
    return x if h is None else x.chunk(2, dim=2)[h]


def _rows(x, h):
    """The rows of the shard that _half(x, h) holds, as a slice of its sequence."""
    half = x.shape[2] // 2
    return (slice(0, half), slice(half, None))[h]


def _local_forward(local, q, k, v, rank, src, world, causal, scale, keys=None):
    """[(rows, o, lse)]: rank's queries against src's block, each part for the rows `rows` of
    the shard (a slice along the sequence), to be merged there; none for rows that see none of
    the block. keys: how many of the block's keys are real (the rest padding), None for all."""
    pairs, local_causal = _step_plan(rank, src, world, causal)
    every = slice(None)
    if keys is not None:  # the queries in windows of `keys` rows against the real keys
        n = q.shape[2]
        if keys == 0:
            return []
        win = _windows(n, keys)
        o, lse = local.forward(torch.cat([q[:, :, a:a + keys] for a, _, _ in win]),
                               torch.cat([k[:, :, :keys]] * len(win)),
                               torch.cat([v[:, :, :keys]] * len(win)), False, scale)
        B = q.shape[0]
        return [(every,
                 torch.cat([o[i * B:(i + 1) * B, :, f - a:e - a] for i, (a, f, e) in enumerate(win)], 2),
                 torch.cat([lse[i * B:(i + 1) * B, :, f - a:e - a] for i, (a, f, e) in enumerate(win)], 2))]
    if pairs == [(None, None)]:
        o, lse = local.forward(q, k, v, local_causal, scale)
        return [(every, o, lse)]
    # a chunk-sized problem a pair, on views of the shard's halves (no copies; stages take
    # queries and keys of one length): src < rank gives one part to each of our chunks, src >
    # rank two to our second
    return [(_rows(q, a), *local.forward(_half(q, a), _half(k, b), _half(v, b), False, scale))
            for a, b in pairs]


def _accumulate(o, lse, parts):
    """Merge _local_forward's parts into the running (o, lse), each into its rows."""
    for rows, o_s, lse_s in parts:
        merge_into(o[:, :, rows], lse[:, :, rows], o_s, lse_s)


def _local_backward(local, q, k, v, o, lse, do, rank, src, world, causal, scale, keys=None):
    """rank's gradients against src's block, as parts to be added where they belong:
    ([(rows, dq)], [(rows, dk, dv)]), rows a slice of the shard's sequence (dq: of ours; dk,
    dv: of the block's)."""
    pairs, local_causal = _step_plan(rank, src, world, causal)
    every = slice(None)
    if keys is not None:  # as _local_forward; dO zero on the rows a window does not own
        if keys == 0:
            return [], []
        B, win = q.shape[0], _windows(q.shape[2], keys)
        rows = lambda x: torch.cat([x[:, :, a:a + keys] for a, _, _ in win])  # noqa: E731
        owned = torch.cat([do[:, :, a:a + keys] * _owned(keys, f - a, e - a, do) for a, f, e in win])
        g = local.backward(rows(q), torch.cat([k[:, :, :keys]] * len(win)),
                           torch.cat([v[:, :, :keys]] * len(win)), rows(o),
                           rows(lse[..., None])[..., 0].contiguous(), owned.contiguous(), False, scale)
        got = [slice(i * B, (i + 1) * B) for i in range(len(win))]
        return ([(slice(f, e), g[0][sl, :, f - a:e - a]) for sl, (a, f, e) in zip(got, win)],
                [(slice(0, keys), g[1][sl], g[2][sl]) for sl in got])
    if pairs == [(None, None)]:
        dq, dk, dv = local.backward(q, k, v, o, lse, do, local_causal, scale)
        return [(every, dq)], [(every, dk, dv)]
    g_q, g_kv = [], []
    for a, b in pairs:  # as _local_forward: a problem a pair, on views of the halves
        dq, dk, dv = local.backward(_half(q, a), _half(k, b), _half(v, b), _half(o, a),
                                    _half(lse, a), _half(do, a), False, scale)
        g_q.append((_rows(q, a), dq))
        g_kv.append((_rows(k, b), dk, dv))
    return g_q, g_kv


def _add(sums, parts):
    """Add gradient parts into their rows of the running fp32 (or float64) sums."""
    for rows, *gs in parts:
        for total, g in zip(sums, gs):
            total[:, :, rows] += g


def _owned(m, first, end, like):
    """A (m, 1) column of ones on rows [first, end) of a window, zeros elsewhere."""
    col = torch.zeros(m, 1, dtype=like.dtype, device=like.device)
    col[first:end] = 1
    return col


def ring_forward(local, q, k, v, causal=False, scale=None, group=None, length=None):
    """(o, lse) of this rank's queries against the whole sequence, its K/V blocks passed around
    the ring (q, k, v: this rank's shard, `shard`'s layout; length: the sequence's real length
    where shard padded it). o in q's dtype, lse fp32 (float64 for float64 inputs)."""
    world, rank, _, _ = _peers(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    for s in range(world):
        nxt = _Pass(kv, group) if s + 1 < world else None   # the next block, on its way
        src = (rank - s) % world
        _accumulate(o, lse, _local_forward(local, q, kv[0], kv[1], rank, src, world, causal,
                                           scale, _keys_in(src, q.shape[2], length, causal)))
        if nxt is not None:
            kv = nxt.wait()
    return o.to(q.dtype), lse


def ring_backward(local, q, k, v, o, lse, do, causal=False, scale=None, group=None, length=None):
    """(dq, dk, dv) of this rank's shard: dQ added here, dK and dV travelling with their block
    and handed back to its owner after the last step. A block's running dK and dV arrive from
    the previous rank while this rank's step computes its share, one step behind the block. They
    travel as fp32 sums, but for the last hop home: complete by then, they go in the inputs' dtype
    (the cast the owner would make, made before sending: the same bits in half the bytes, on the
    one hop no step's compute hides)."""
    world, rank, _, _ = _peers(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    back = None  # the running dK and dV of the block held, on their way from the previous rank
    for s in range(world):
        nxt = _Pass(kv, group) if s + 1 < world else None
        src = (rank - s) % world
        g_q, g_kv = _local_backward(local, q, kv[0], kv[1], o, lse, do, rank, src, world,
                                    causal, scale, _keys_in(src, q.shape[2], length, causal))
        _add([dq], g_q)
        dkv = (back.wait() if back is not None else
               [torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(2)])
        _add(dkv, g_kv)
        if nxt is None:  # the last hop, home: in the inputs' dtype
            dkv = [dkv[0].to(k.dtype), dkv[1].to(v.dtype)]
        back = _Pass(dkv, group)
        if nxt is not None:
            kv = nxt.wait()
    dk, dv = back.wait()
    return dq.to(q.dtype), dk, dv


def _rank_forward(local, q, block, rank, world, causal, scale, length):
    """(o, lse) of rank's queries against every rank's block, block(src) -> (k, v), with no
    communication: the ring's steps one after another, merged in fp32 (float64 stays float64)."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=acc, device=q.device)
    for s in range(world):
        src = (rank - s) % world
        _accumulate(o, lse, _local_forward(local, q, *block(src), rank, src, world, causal, scale,
                                           _keys_in(src, q.shape[2], length, causal)))
    return o.to(q.dtype), lse


def _rank_backward(local, q, o, lse, do, block, rank, world, causal, scale, length):
    """[(src, (dq parts, dk-dv parts))]: rank's share of the gradients against each rank's
    block (_local_backward's), in the ring's order, with no communication."""
    out = []
    for s in range(world):
        src = (rank - s) % world
        out.append((src, _local_backward(local, q, *block(src), o, lse, do, rank, src, world,
                                         causal, scale, _keys_in(src, q.shape[2], length, causal))))
    return out


def simulate(local, q, k, v, do, world, causal=False, scale=None):
    """The ring's arithmetic in one process, without communication: every rank's steps in turn on
    full-sequence q, k, v and dO (the shards cut here), as ring_forward and ring_backward take them.
    Returns full-sequence (o, lse, dq, dk, dv): a check of the split, the merge and the gradients'
    bookkeeping with a stage as local attention on one GPU."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    cut = lambda t, r: shard(t, world, r, causal)  # noqa: E731
    block = lambda src: (cut(k, src), cut(v, src))  # noqa: E731
    N = q.shape[2]
    outs = [_rank_forward(local, cut(q, r), block, r, world, causal, scale, N)
            for r in range(world)]
    dq = [torch.zeros(cut(q, r).shape, dtype=acc, device=q.device) for r in range(world)]
    dk, dv = [torch.zeros_like(t) for t in dq], [torch.zeros_like(t) for t in dq]
    for r in range(world):
        o, lse = outs[r]
        for src, (g_q, g_kv) in _rank_backward(local, cut(q, r), o, lse, cut(do, r), block, r,
                                               world, causal, scale, N):
            _add([dq[r]], g_q)
            _add([dk[src], dv[src]], g_kv)
    whole = lambda parts: unshard(parts, causal, length=N)  # noqa: E731
    return (whole([o for o, _ in outs]), whole([lse[..., None] for _, lse in outs])[..., 0],
            whole([t.to(q.dtype) for t in dq]), whole([t.to(q.dtype) for t in dk]),
            whole([t.to(q.dtype) for t in dv]))


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, local, causal, scale, group, length):
        o, lse = ring_forward(local, q, k, v, causal, scale, group, length)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (local, causal, scale, group, length)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        local, causal, scale, group, length = ctx.args
        dq, dk, dv = ring_backward(local, q, k, v, o, lse, do.contiguous(), causal, scale, group,
                                   length)
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q, k, v, causal=False, scale=None, local=None, group=None, return_lse=False,
                   length=None):
    """Attention of this rank's shard of the queries against the whole sequence: q, k, v are
    this rank's shard (`shard`), local the attention each step runs (default: float64 reference),
    length the sequence's real length where shard padded it (its rows past length come out as
    garbage that unshard drops; their dO must be zero, as shard pads it). Differentiable: where
    autograd records the call, the gradients run the ring backward."""
    local = reference_local() if local is None else local
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"ring attention takes q, k, v shards of one shape (B, H, n, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if causal and q.shape[2] % 2:
        raise ValueError(f"a causal ring's shard holds two chunks of equal length (zig-zag): "
                         f"its length {q.shape[2]} is odd")
    if length is not None:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        full = q.shape[2] * world
        if not (isinstance(length, int) and full - (2 * world if causal else world) < length <= full):
            raise ValueError(f"length {length!r}: {world} shards of {q.shape[2]} rows hold a "
                             f"sequence of {full} rows at most, padded by less than a chunk a rank")
    o, lse = _Ring.apply(q, k, v, local, bool(causal), scale, group, length)
    return (o, lse) if return_lse else o


# --- a check on CPUs: the ring against float64 attention on the whole sequence --------------------

def _wrong_lse(q, k, v, causal, scale):
    o, lse = _ref_forward(q, k, v, causal, scale)
    return o, lse + 0.5


def _no_delta(q, k, v, o, lse, do, causal, scale):
    return _ref_backward(q, k, v, torch.zeros_like(o), lse, do, causal, scale)


LOCALS = {  # by name, for check()'s processes: the reference and two wrong ones it must catch
    "reference": reference_local,
    "wrong_lse": lambda: Local("wrong_lse", _wrong_lse, _ref_backward),
    "no_delta": lambda: Local("no_delta", _ref_forward, _no_delta),
}


def _check_worker(rank, world, causal, shape, seed, init, results, local, stage, dtype):
    on_gpu = stage is not None
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init, rank=rank,
                            world_size=world)
    try:
        gen = torch.Generator().manual_seed(seed)  # every rank draws the same whole sequence
        B, H, N, D = shape
        dev = f"cuda:{rank}" if on_gpu else "cpu"
        q, k, v, do = (torch.randn(B, H, N, D, generator=gen, dtype=torch.float64).to(dev)
                       for _ in range(4))
        ref = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o_ref, lse_ref = _ref_forward(*ref, causal, D ** -0.5)
        o_ref.backward(do)
        wanted = [o_ref, lse_ref, *(t.grad for t in ref)]
        if on_gpu:
            import flashlab as fl
            from .inputs import dtype_of
            attn = fl.stage(stage).build()
            chosen = stage_local(attn)
            q, k, v, do = (t.to(dtype_of(dtype)) for t in (q, k, v, do))
        else:
            chosen = LOCALS[local]()
        mine = [shard(t, world, rank, causal).requires_grad_(True) for t in (q, k, v)]
        o, lse = ring_attention(*mine, causal=causal, local=chosen, return_lse=True, length=N)
        o.backward(shard(do, world, rank, causal))
        got = [o, lse, *(t.grad for t in mine)]
        real = shard(torch.ones(1, 1, N), world, rank, causal, dim=2)[0, 0] > 0  # not padding
        kept = lambda t: t.detach()[:, :, real.to(t.device)]  # noqa: E731  (a shard's real rows)
        mine_of = lambda t: kept(shard(t.detach(), world, rank, causal))  # noqa: E731  (whole's)
        names = ("o", "lse", "dq", "dk", "dv")
        if not on_gpu:
            errs = {n: float((kept(g) - mine_of(w)).abs().max()) for n, g, w in zip(names, got, wanted)}
            results.put((rank, errs))
            return
        # a stage: relative errors, beside the stage's own on the whole sequence (one GPU)
        from .reference import grad_err
        full = [t.detach().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            o_own, lse_own = attn(*full, causal=causal, return_lse=True)
            own = [o_own, lse_own, *torch.autograd.grad(o_own, full, do)]
        errs = {n: grad_err(kept(g), mine_of(w)) for n, g, w in zip(names, got, wanted)}
        owns = {n: grad_err(mine_of(g), mine_of(w)) for n, g, w in zip(names, own, wanted)}
        results.put((rank, {n: (errs[n], owns[n]) for n in names}))
    finally:
        dist.destroy_process_group()


def check(world=2, causal=False, shape=(1, 2, 48, 16), seed=0, local="reference", stage=None,
          dtype="fp16") -> dict:
    """The ring against float64 attention on the whole sequence, forward and backward, each rank
    on its shard of one random sequence. Without `stage`: `world` CPU processes on the gloo
    backend, a LOCALS attention (the float64 reference by default) in float64; returns {rank:
    {o, lse, dq, dk, dv: largest difference}}. With `stage` (a built stage's number or slug):
    one process per GPU on NCCL, the stage as local attention in `dtype`; returns {rank: {name:
    (the ring's relative error, the stage's own on the whole sequence)}}."""
    import tempfile
    import torch.multiprocessing as mp
    _split(shape[2], world, causal)
    if stage is not None and torch.cuda.device_count() < world:
        raise ValueError(f"a ring of {world} GPUs needs {world} GPUs here, found "
                         f"{torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_check_worker, args=(world, causal, shape, seed, f"file://{tmp}/rdzv",
                                                results, local, stage, dtype),
                           nprocs=world, start_method="spawn")
        out = dict(results.get() for _ in range(world))
    return out


# --- measured on the GPUs of one machine (launched by torchrun, NCCL) -------------------------------

def _timed(fn, runs, group, warm=2, alone=False) -> float:
    """The slowest rank's time of one call in ms, the median over `runs` calls (each after a
    barrier), after `warm` calls; alone: this rank's own time, no barrier or reduction (one GPU's
    run while the others wait)."""
    import statistics
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        if not alone:
            dist.barrier(group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        if not alone:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t))
    return statistics.median(times)


def _compute_only(local, q, k, v, do, causal, length, group, training):
    """The ring's local work with no communication: each step's problem on this rank's own K/V
    (the same shapes as the ring's), merged; with training, each step's backward too."""
    world, rank, _, _ = _peers(group)
    scale, block = q.shape[-1] ** -0.5, lambda src: (k, v)
    o, lse = _rank_forward(local, q, block, rank, world, causal, scale, length)
    if training:
        _rank_backward(local, q, o, lse, do, block, rank, world, causal, scale, length)


def _comm_only(k, v, group, training):
    """The ring's communication with no compute, as ring_forward and ring_backward send it:
    world - 1 passes of K/V (and with training, world - 1 more of K/V and world of dK/dV, in fp32
    but for the last, home, in the inputs' dtype). Returns the bytes this rank sent."""
    world = dist.get_world_size(group)
    sent = 0

    def send(ts):
        nonlocal sent
        sent += sum(t.numel() * t.element_size() for t in ts) if world > 1 else 0
        return _Pass(ts, group).wait()

    kv = [k, v]
    for _ in range(world - 1):
        kv = send(kv)
    if training:
        dkv = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(2)]
        for s in range(world):
            if s + 1 < world:
                kv = send(kv)
            dkv = send(dkv if s + 1 < world else [dkv[0].to(k.dtype), dkv[1].to(v.dtype)])
    return sent


def _context_parallel_times(backend, q, k, v, causal, runs, group, do_seed):
    """(forward ms, training ms) of PyTorch's context_parallel with SDPA's `backend` on the same
    GPUs: q, k, v the whole sequence, sharded in place by context_parallel (its head-tail load
    balancing where causal: it takes no other)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    mesh = init_device_mesh("cuda", (dist.get_world_size(group),))
    bufs = [t.clone() for t in (q, k, v)]
    balance, _cp_options.enable_load_balance = _cp_options.enable_load_balance, bool(causal)
    try:
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2],
                              no_restore_buffers=set(bufs)), sdpa_kernel(which[backend]):
            with torch.no_grad():
                fwd = _timed(lambda: F.scaled_dot_product_attention(*bufs, is_causal=causal),
                             runs, group)
            leaves = [t.detach().requires_grad_(True) for t in bufs]
            gen = torch.Generator("cuda").manual_seed(do_seed)
            do = torch.randn(bufs[0].shape, generator=gen, device="cuda", dtype=q.dtype)
            trn = _timed(lambda: F.scaled_dot_product_attention(*leaves, is_causal=causal)
                         .backward(do), runs, group)
    finally:
        _cp_options.enable_load_balance = balance
    return fwd, trn


def measure(stage=None, lengths=(32768, 131072), dtypes=("fp16",), heads=16, D=128,
            causal=(False, True), runs=10, single_up_to=262144, baselines=("sdpa_cudnn", "sdpa_flash"),
            record=True, log=print, group=None) -> list:
    """Ring attention with `stage` as local attention on this machine's GPUs, beside PyTorch's
    context_parallel with SDPA's cuDNN and flash backends, in one run: each config's forward and
    (for a stage with a backward pass) training step, forward and backward, timed in turn, with the ring's compute alone and its
    communication alone (the share hidden), and one GPU's time where N <= single_up_to (the
    scaling efficiency). Call in every rank of a torchrun launch (NCCL initialised, this rank's
    GPU set). Rows go to data/ring.csv on rank 0 (tables.RING). Returns rank 0's rows. stage:
    default the last stage with a backward pass."""
    import flashlab as fl
    if stage is None:
        from .stages import last_backward
        stage = last_backward().slug
    from . import configs, tables
    from .env import environment
    from .inputs import dtype_of
    world, rank, _, _ = _peers(group)
    attn = fl.stage(stage).build()
    local = stage_local(attn)
    trains = attn.stage.has_backward  # a forward-only stage (05-13): the forward's rows only
    env = environment()
    rows = []
    for dt in dtypes:
        for N in lengths:
            for c in causal:
                gen = torch.Generator("cuda").manual_seed(N)
                q, k, v, do = (torch.randn(1, heads, N, D, generator=gen, device="cuda",
                                           dtype=dtype_of(dt)) for _ in range(4))
                mine = [shard(t, world, rank, c) for t in (q, k, v, do)]
                times = {}
                with torch.no_grad():
                    times["forward"] = _timed(lambda: ring_forward(local, *mine[:3], c, None, group, N),
                                              runs, group)
                    comp_f = _timed(lambda: _compute_only(local, *mine, c, N, group, False), runs, group)
                    comm_f = _timed(lambda: _comm_only(*mine[1:3], group, False), runs, group)
                    sent = {"forward": _comm_only(*mine[1:3], group, False)}
                leaves = [t.detach().requires_grad_(True) for t in mine[:3]]

                def train():
                    ring_attention(*leaves, causal=c, local=local, group=group, length=N).backward(mine[3])
                times["training"] = _timed(train, runs, group) if trains else math.nan
                comp_t = _timed(lambda: _compute_only(local, *mine, c, N, group, True), runs,
                                group) if trains else math.nan
                comm_t = _timed(lambda: _comm_only(*mine[1:3], group, True), runs,
                                group) if trains else math.nan
                sent["training"] = _comm_only(*mine[1:3], group, True) if trains else math.nan
                single = {"forward": math.nan, "training": math.nan}
                if N <= single_up_to:
                    t = torch.zeros(2, device="cuda")
                    if rank == 0:
                        with torch.no_grad():
                            t[0] = _timed(lambda: attn(q, k, v, causal=c), max(3, runs // 2),
                                          group, warm=1, alone=True)
                        full = [x.detach().requires_grad_(True) for x in (q, k, v)]
                        t[1] = (_timed(lambda: attn(*full, causal=c).backward(do),
                                       max(3, runs // 2), group, warm=1, alone=True)
                                if trains else math.nan)
                    dist.broadcast(t, 0, group)
                    single = {"forward": float(t[0]), "training": float(t[1])}
                base = {b: _context_parallel_times(b, q, k, v, c, runs, group, N) for b in baselines}
                fl_f = configs.flops(1, heads, N, D, c, "forward")
                fl_b = configs.flops(1, heads, N, D, c, "backward")
                passes = [("forward", fl_f, comp_f, comm_f)]
                passes += [("training", fl_f + fl_b, comp_t, comm_t)] if trains else []
                for pass_, flops, comp, comm in passes:
                    ms = times[pass_]
                    hidden = (max(0.0, min(1.0, (comp + comm - ms) / comm)) if world > 1 and comm > 0
                              else math.nan)
                    rows.append(dict(impl=f"ring:{stage}", **{"pass": pass_}, gpus=world, dtype=dt,
                                     B=1, H=heads, N=N, D=D, causal=c, median_ms=ms,
                                     tflops=flops / ms / 1e9, single_ms=single[pass_],
                                     efficiency=single[pass_] / (world * ms), compute_ms=comp,
                                     comm_ms=comm, comm_bytes=sent[pass_], hidden=hidden,
                                     runs=runs, **env))
                    for b, (bf, bt) in base.items():
                        bms = bf if pass_ == "forward" else bt
                        rows.append(dict(impl=f"context_parallel:{b}", **{"pass": pass_}, gpus=world,
                                         dtype=dt, B=1, H=heads, N=N, D=D, causal=c, median_ms=bms,
                                         tflops=flops / bms / 1e9, runs=runs, **env))
                    if rank == 0:
                        log(f"{world} GPU{'s' * (world > 1)} N={N:<8} {dt} {'causal' if c else 'full  '}"
                            f" {pass_:8} ring {ms:9.2f} ms ({flops / ms / 1e9:5.0f} TFLOP/s, "
                            f"hidden {hidden:.0%}, efficiency {single[pass_] / (world * ms):.0%})  "
                            + "  ".join(f"{b} {(bf if pass_ == 'forward' else bt):9.2f} ms"
                                        for b, (bf, bt) in base.items()))
                q = k = v = do = mine = leaves = None  # the next config's inputs in their place
                torch.cuda.empty_cache()
    if record and rank == 0:
        tables.RING.upsert(rows)
    return rows



# --- on paper: when does the ring hide its communication? -------------------------------------------

# What one GPU's transfer to its ring neighbour gets, GB/s each way: NVLink 4 through NVSwitch
# within an H100 SXM machine (900 GB/s both ways together), one 400 Gb/s InfiniBand NDR port a
# GPU between machines. A ring over several machines waits on its slowest hop.
LINKS_GBS = {"nvlink4": 450.0, "ib_ndr": 50.0}


def step_model(N, gpus, tflops, link_gbs, heads=16, D=128, causal=False, training=False,
               bytes_per=2) -> dict:
    """One ring step on paper, in ms: the local attention's FLOPs (FlashAttention's count, the
    zig-zag split giving every causal step half a block's work) at `tflops`, against a K/V block's
    bytes over a link of `link_gbs` each way. With training, the backward's ring too: 2.5 times
    the FLOPs, and dK, dV (fp32) travelling beside K and V. A step takes the longer of the two
    (the transfer overlaps the compute); efficiency = compute / step time, what the ring keeps
    of `gpus` times one GPU. Latency and the merge are left out."""
    n = N / gpus
    work = 0.5 if causal else 1.0
    fwd = 4 * heads * n * n * D * work / (tflops * 1e12) * 1e3
    kv = heads * n * D * 2 * bytes_per / (link_gbs * 1e9) * 1e3
    compute, step = fwd, max(fwd, kv)
    comm = kv
    if training:
        bwd = 2.5 * fwd
        back = heads * n * D * (2 * bytes_per + 2 * 4) / (link_gbs * 1e9) * 1e3
        compute, step, comm = fwd + bwd, step + max(bwd, back), kv + back
    return dict(compute_ms=compute, comm_ms=comm, step_ms=step, efficiency=compute / step,
                hidden=min(1.0, compute / comm) if comm else 1.0)


def single_tflops(r) -> float:
    """The rate one GPU reached on the whole sequence in a recorded ring row (its single_ms), by
    FlashAttention's count (the forward's 4·H·N²·D, 3.5 times that for a training step, half under
    the mask); NaN where one GPU was not timed."""
    flops = (4 * r["B"] * r["H"] * r["N"] ** 2 * r["D"] * (0.5 if r["causal"] else 1.0)
             * (3.5 if r["pass"] == "training" else 1.0))
    return flops / (r["single_ms"] * 1e9) if r["single_ms"] == r["single_ms"] else float("nan")


def model_vs_runs(rows=None, gpu=None, link_gbs=LINKS_GBS["nvlink4"]):
    """The paper model (step_model) against the recorded ring runs (tables.ring_rows), a row
    each: the communication alone, measured and on paper at `link_gbs` (the link each way, its
    speed as the bandwidth the model assumes), and where the efficiency went: `compute_ideal`,
    one GPU's time over the GPUs against the ring's compute alone (the local attention on
    shards: smaller problems, the causal split's chunk pairs), and `exposed`, the step's time
    beyond its compute alone, against the communication alone. The paper's communication counts
    what _comm_only times: world - 1 hops of a K/V block, and with training world - 1 more and
    world hops of dK, dV in fp32, the last one home (in the inputs' dtype where the row records
    comm_bytes, the bytes sent); `link_gbs_measured` is the bandwidth those
    bytes reached. The model takes the compute at
    the rate one GPU ran the whole sequence (single_ms), so it predicts efficiency 1 wherever
    the transfer hides; what the runs lose besides is the ring's own compute and overheads.
    A row each recorded run: `impl` names its local attention ("ring:20_warpspec_backward")."""
    import pandas as pd
    from . import tables
    rows = tables.ring_rows(rows, gpu)
    out = []
    for _, r in rows.iterrows():
        training = r["pass"] == "training"
        rate = single_tflops(r)
        m = step_model(r["N"], r["gpus"], rate, link_gbs, heads=r["H"], D=r["D"],
                       causal=r["causal"], training=training,
                       bytes_per=2 if r["dtype"] in ("fp16", "bf16") else 4)
        g, n = r["gpus"], r["N"] / r["gpus"]
        sent = r.get("comm_bytes")  # what the run's rank sent, where the run recorded it
        if sent is None or pd.isna(sent):  # runs before it: dK and dV went home in fp32 too
            kv = r["H"] * n * r["D"] * 2 * (2 if r["dtype"] in ("fp16", "bf16") else 4)  # a hop
            sent = (g - 1) * kv + (((g - 1) * kv + g * r["H"] * n * r["D"] * 2 * 4) if training
                                   else 0)
        out.append({"impl": r["impl"], "gpus": r["gpus"], "dtype": r["dtype"], "pass": r["pass"],
                    "N": r["N"], "causal": r["causal"],
                    "comm_ms": r["comm_ms"], "comm_ms_paper": sent / (link_gbs * 1e9) * 1e3,
                    "link_gbs_measured": sent / (r["comm_ms"] * 1e6),
                    "efficiency": r["efficiency"], "efficiency_paper": m["efficiency"],
                    "compute_ideal": r["single_ms"] / r["gpus"] / r["compute_ms"],
                    "exposed_ms": max(0.0, r["median_ms"] - r["compute_ms"])})
    return pd.DataFrame(out)


def step_work(world, causal=True, split="zigzag"):
    """The scores each rank computes at each ring step, in units of a whole block's (n², n = N /
    world queries against n keys): work[s][r] for rank r at step s, when it holds rank (r - s) mod
    world's keys and values. Without the mask every step is 1. With it, a contiguous split gives
    rank r the first r + 1 blocks' keys (the diagonal block half), so some rank has a whole block
    while another has none; the zig-zag split (chunks r and 2·world - 1 - r) gives every rank half a
    block at every step (_step_plan's pairs: two chunk pairs of a quarter block each)."""
    import numpy as np
    if split not in ("zigzag", "contiguous"):
        raise ValueError(f"split is 'zigzag' or 'contiguous', not {split!r}")
    if not (isinstance(world, int) and world >= 1):
        raise ValueError(f"a ring has a whole number of ranks, at least 1, not {world!r}")
    work = np.ones((world, world))
    if causal:
        for s in range(world):
            for r in range(world):
                src = (r - s) % world
                work[s, r] = 0.5 if split == "zigzag" or src == r else float(src < r)
    return work


def balance(world, causal=True, split="zigzag") -> float:
    """The share of the ring's time the average rank computes, when every step lasts as long as
    its busiest rank's local attention (the ranks pass their blocks on together): the mean work
    over the sum of each step's largest (step_work). 1.0 is perfect balance."""
    work = step_work(world, causal, split)
    return float(work.sum() / world / work.max(axis=1).sum())


def tokens_to_hide(tflops, link_gbs, causal=False, training=False, bytes_per=2) -> float:
    """The fewest tokens a GPU must hold for its ring step's compute to cover the transfer (from
    step_model: the compute grows with n², the bytes with n)."""
    work = 0.5 if causal else 1.0
    rate, link = tflops * 1e12, link_gbs * 1e9
    need = 2 * bytes_per * rate / (4 * work * link)                     # the forward's ring
    if training:
        need = max(need, (2 * bytes_per + 8) * rate / (10 * work * link))  # the backward's
    return need
