"""A stage as a model's attention: a function with SDPA's signature, and its registration as a
transformers attention implementation, so a GPT-2 built from its config (no download) runs on a
flashlab kernel. transformers is an optional extra (`pip install -e ".[model]"`).

    from flashlab import model
    name = model.register("08_tuned")                 # "fl_08_tuned"
    gpt2 = model.gpt2(attn_implementation=name).cuda().half()

What a flashlab kernel cannot compute is refused with a ValueError, never approximated: an
attention mask other than "causal or none", dropout, a query length different from the key
length (decoding with a KV cache), grouped heads. A stage with a backward pass trains: in
training the model's q, k and v require grad and the stage's autograd function computes their
gradients (train() fine-tunes a GPT-2 on it). Models hand over (B, H, N, D) views of
(B, N, H, D) projections, rows strided. Stages whose registry entry has row_strides (05 on)
read those views as they are and write the output straight into a (B, N, H, D) tensor, the
layout the model continues with: no copy either way. Earlier stages read contiguous tensors
only, so for them the adapter copies each input (`copies` counts them).
"""
import math

import torch

from .dtypes import HALF
from .inputs import reads_in_place
from .stages import stage as _stage
from .stages import stages as _all_stages


class SDPA:
    """attn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False), as torch.nn.functional.scaled_dot_product_attention, computed by
    `attention` (a built stage, or any callable attn(q, k, v, causal=, scale=) on contiguous
    (B, H, N, D) tensors)."""

    def __init__(self, attention, name=None):
        self.attention = attention
        self.name = name or getattr(getattr(attention, "stage", None), "slug", "attention")
        self.copies = 0  # inputs that had to be made contiguous
        stage = getattr(attention, "stage", None)
        self.row_strides = bool(getattr(stage, "row_strides", False))

    def __repr__(self):
        return f"<flashlab SDPA adapter for {self.name}: {self.copies} inputs copied>"

    def _readable(self, name, t):
        """t itself where the stage can read it in place, else a contiguous copy (counted)."""
        if reads_in_place(self.name, name, t, self.row_strides):
            return t
        self.copies += 1
        return t.contiguous()

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                 scale=None, enable_gqa=False):
        who = self.name
        if attn_mask is not None:
            raise ValueError(f"{who}: flashlab kernels take no attention mask (only is_causal)")
        if dropout_p:
            raise ValueError(f"{who}: flashlab kernels have no dropout (dropout_p={dropout_p})")
        if enable_gqa or key.shape[1] != query.shape[1]:
            raise ValueError(f"{who}: flashlab kernels need as many key/value heads as query heads "
                             f"(q has {query.shape[1]}, k has {key.shape[1]})")
        if query.dim() != 4:
            raise ValueError(f"{who}: expected (B, H, N, D) tensors, got q of shape {tuple(query.shape)}")
        if key.shape[2] != query.shape[2]:
            raise ValueError(f"{who}: flashlab kernels need as many keys as queries (q has "
                             f"{query.shape[2]}, k has {key.shape[2]}); decode without a KV cache "
                             "(use_cache=False)")
        q, k, v = (self._readable(n, t) for n, t in zip("qkv", (query, key, value)))
        if scale is not None and math.isclose(scale, 1 / math.sqrt(q.shape[-1]), rel_tol=1e-6):
            scale = None  # the kernels' own default
        recorded = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        if not self.row_strides or recorded:  # training: autograd's output is a tensor of its own
            return self.attention(q, k, v, causal=bool(is_causal), scale=scale)
        # (B, N, H, D) memory seen as (B, H, N, D): the model's next step reads it as it is
        B, H, N, D = q.shape
        out = torch.empty(B, N, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
        return self.attention(q, k, v, causal=bool(is_causal), scale=scale, out=out)


def sdpa(stage_or_attention):
    """The SDPA-shaped adapter for a stage (slug or number: built here) or a built attention."""
    attention = stage_or_attention
    if isinstance(stage_or_attention, (str, int)):
        attention = _stage(stage_or_attention).build()
    return SDPA(attention)


def _transformers_forward(adapter):
    """transformers' attention-interface signature: (module, query, key, value, attention_mask,
    dropout, scaling, is_causal, ...) -> ((B, N, H, D) output, no weights)."""

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                is_causal=None, **kwargs):
        if kwargs.get("output_attentions"):
            raise ValueError(f"{adapter.name}: flashlab kernels do not return attention weights")
        for unsupported in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{adapter.name}: flashlab kernels do not support {unsupported}")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and query.shape[2] > 1
        out = adapter(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                      is_causal=causal, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return forward


def _no_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
             attention_mask=None, **kwargs):
    """The mask transformers would build for us: none (causality goes as is_causal); a padding
    mask that masks something cannot be honoured, so it is refused."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("flashlab kernels take no padding mask: pass unpadded sequences of equal "
                         "length (or no attention_mask)")
    return None


def register(stage_or_attention, name=None) -> str:
    """Register a stage as a transformers attention implementation; returns its name, to pass as
    `attn_implementation=`. (Not "flashlab_…": transformers takes any name containing "flash"
    for one of its FlashAttention kernels.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    adapter = stage_or_attention if isinstance(stage_or_attention, SDPA) else sdpa(stage_or_attention)
    name = name or f"fl_{adapter.name}"
    if "flash" in name:
        raise ValueError(f"{name!r}: transformers reads a name containing 'flash' as one of its "
                         "own FlashAttention kernels; choose another")
    AttentionInterface.register(name, _transformers_forward(adapter))
    AttentionMaskInterface.register(name, _no_mask)
    register.adapters[name] = adapter
    return name


register.adapters = {}


def gpt2(attn_implementation="sdpa", n_layer=4, n_head=12, n_embd=768, n_positions=1024, seed=0,
         **config):
    """A GPT-2 built from its config (random weights, nothing downloaded), in eval mode, with
    the given attention implementation; head dim n_embd / n_head (64 for GPT-2)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=n_positions,
                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **config)
    cfg._attn_implementation = attn_implementation
    m = GPT2LMHeadModel(cfg)
    m.config._attn_implementation = attn_implementation
    # the loss transformers takes for this class anyway, named so that it does not warn it guessed
    m.loss_type = "ForCausalLM"
    return m.eval()


def compare_logits(model_a, model_b, tokens) -> dict:
    """The largest absolute difference between two models' logits on `tokens` (same weights
    assumed), and the largest logit, for a relative reading."""
    with torch.no_grad():
        a = model_a(tokens, use_cache=False).logits.float()
        b = model_b(tokens, use_cache=False).logits.float()
    return {"max_abs_diff": float((a - b).abs().max()), "max_abs_logit": float(a.abs().max())}


def flops(n_layer=12, n_embd=768, seq=1024, batch=1, vocab=50257, causal=True) -> dict:
    """Forward-pass FLOPs of a GPT-2 by part, counting a multiply-add as 2: the per-layer matmuls
    (QKV 6·N·d², output projection 2·N·d², MLP 16·N·d²), attention (QKᵀ and PV, 4·N²·d, half
    of it when causal, as flashlab counts attention) and the LM head (2·N·d·V)."""
    N, d = seq, n_embd
    attention = n_layer * 4 * N * N * d * (0.5 if causal else 1.0)
    return {"matmuls": batch * n_layer * 24 * N * d * d, "attention": batch * attention,
            "lm_head": batch * 2 * N * d * vocab}


# How a GPU kernel's name says what it computes (checked in this order; the stages' own kernels
# are added from the registry): SDPA's flash, memory-efficient and cuDNN kernels, then cuBLAS's
# matmuls (nvjet and sm90_xmma on Hopper, cutlass and gemm elsewhere).
ATTENTION_NAMES = ("flash", "fmha", "attention", "sdpa")
MATMUL_NAMES = ("nvjet", "gemm", "xmma", "cutlass", "matmul", "gemv")


def kernel_kind(name, stage_kernels=None) -> str:
    """'attention', 'matmul' or 'other' for a CUDA kernel's name (stage_kernels: the names that
    count as attention besides ATTENTION_NAMES; default, every stage's kernel in the registry)."""
    if stage_kernels is None:
        stage_kernels = [st.kernel for st in _all_stages()]
    low = name.lower()
    if any(k in name for k in stage_kernels) or any(a in low for a in ATTENTION_NAMES):
        return "attention"
    if any(m in low for m in MATMUL_NAMES):
        return "matmul"
    return "other"


def gpu_time_by_kind(fn, stage_kernels=None, calls=1) -> dict:
    """fn called `calls` times under torch.profiler: the GPU time of its kernels in ms per call,
    by kernel_kind, and in all ("busy": the GPU's time computing; a forward pass's elapsed time,
    event to event, minus this is time the GPU waited for the CPU to launch work); "attention_kernels": the
    attention kernels' names (which backend SDPA chose)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if stage_kernels is None:
        stage_kernels = [st.kernel for st in _all_stages()]
    ms, names = {"attention": 0.0, "matmul": 0.0, "other": 0.0}, set()
    for evt in prof.events():
        if getattr(evt, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(evt.name, stage_kernels)
            ms[kind] += evt.time_range.elapsed_us() / 1e3 / calls
            if kind == "attention":
                names.add(evt.name.split("(")[0].split("<")[0].removeprefix("void ")[:60])
    ms["busy"] = sum(ms.values())
    ms["attention_kernels"] = ", ".join(sorted(names))
    return ms


def measure(stages=None, dtypes=HALF, batch=8, seq=1024, n_layer=12, record=True,
            log=print, seed=0):
    """A GPT-2 (12 layers by default, random weights) with SDPA, eager and each stage as its
    attention, on the same tokens and weights: the largest logit difference from SDPA, the
    inputs the adapter had to copy per forward pass, the forward pass's time (warmed, L2
    flushed, median) and its GPU time by kind of kernel (gpu_time_by_kind; eager's attention is
    ordinary matmuls and softmax kernels, so it counts as matmul and other). Stages: the fast ones this GPU runs in each dtype. Records data/model.csv;
    returns the rows."""
    import pandas as pd

    from .bench import time_fn
    from .env import environment
    from .inputs import dtype_of
    from .tables import MODEL

    chosen = [_stage(s) for s in stages] if stages else [st for st in _all_stages() if st.fast]
    env, rows = environment(), []
    for dt in dtypes:
        dtype = dtype_of(dt)
        base = gpt2("sdpa", n_layer=n_layer).cuda().to(dtype)
        weights = base.state_dict()
        cfg = base.config
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda", generator=gen)
        with torch.no_grad():
            ref = base(tokens, use_cache=False).logits.float()
        impls = [("sdpa", "baseline", None), ("eager", "baseline", None)]
        for st in chosen:
            why = st.unavailable(dtype=dt) if dt in st.dtypes else f"{st.slug} takes no {dt}"
            if why:
                log(f"{st.slug} {dt}: not run here: {why}")
                continue
            impls.append((st.slug, "stage", register(st.slug)))
        for impl, kind, name in impls:
            m = base
            if impl != "sdpa":
                m = gpt2(name or impl, n_layer=n_layer).cuda().to(dtype)
                m.load_state_dict(weights)
            adapter = register.adapters.get(name)
            with torch.no_grad():
                if adapter is not None:
                    adapter.copies = 0
                logits = m(tokens, use_cache=False).logits.float()
                copies = adapter.copies if adapter is not None else 0
                diff = float((logits - ref).abs().max())
                del logits
                t = time_fn(lambda: m(tokens, use_cache=False))
                try:
                    by = gpu_time_by_kind(lambda: m(tokens, use_cache=False))
                except Exception as err:  # noqa: BLE001 -- no profiler here: times stay unknown
                    log(f"gpu time by kind not measured: {err}")
                    by = {}
            rows.append(dict(model="gpt2", impl=impl, kind=kind, dtype=dt, batch=batch, seq=seq,
                             n_layer=n_layer, n_head=cfg.n_head, head_dim=cfg.n_embd // cfg.n_head,
                             max_abs_diff=diff, max_abs_logit=float(ref.abs().max()),
                             forward_ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms,
                             tokens_per_s=batch * seq / (t.median_ms * 1e-3), input_copies=copies,
                             attention_gpu_ms=by.get("attention"), matmul_gpu_ms=by.get("matmul"),
                             other_gpu_ms=by.get("other"), busy_gpu_ms=by.get("busy"),
                             attention_kernels=by.get("attention_kernels", ""),
                             runs=t.runs, retimes=t.retimes, note=t.note, **env))
            log(f"gpt2 {dt} {impl:12} max|Δlogit| {diff:.4g}  {t.median_ms:8.3f} ms  "
                f"input copies {copies}  GPU ms: " +
                ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in by.items()))
            if m is not base:
                del m
            if impl != "eager":
                rows += attention_alone(impl, adapter, dt, batch, seq, cfg, env, log)
        del base, ref
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    if record and len(df):
        MODEL.upsert(df)
    return df


def attention_alone(impl, adapter, dt, batch, seq, cfg, env, log=print, calls=20) -> list:
    """One attention call as GPT-2 makes it (B, H, N, D = batch, heads, seq, head dim; causal),
    alone, in the model's layout ("bnhd": views of one (B, N, 3, H, D) projection, output into
    (B, N, H, D)) and in contiguous tensors: its kernels' GPU time per call (the profiler, over
    `calls` calls: attention, and copies as other), its wall time (bench.time_fn: call after
    call, what the GPU took per call) and the host's time per call (bench.host_ms: the Python
    call and its launches, which a model pays whenever the GPU catches up with it)."""
    from .bench import host_ms, time_fn
    from .configs import flops
    from .check import case_inputs
    from .inputs import dtype_of

    H, D = cfg.n_head, cfg.n_embd // cfg.n_head
    call = (adapter if adapter is not None else
            torch.nn.functional.scaled_dot_product_attention)
    rows = []
    for layout in ("bnhd", "contiguous"):
        q, k, v, _ = case_inputs(batch, H, seq, D, dtype_of(dt), layout)
        if adapter is not None:
            adapter.copies = 0
        call(q, k, v, is_causal=True)
        copies = adapter.copies if adapter is not None else 0
        t = time_fn(lambda: call(q, k, v, is_causal=True))
        host = host_ms(lambda: call(q, k, v, is_causal=True))
        by = gpu_time_by_kind(lambda: call(q, k, v, is_causal=True), calls=calls)
        rows.append(dict(model="gpt2-attention", impl=impl, kind="baseline" if adapter is None
                         else "stage", layout=layout, dtype=dt, batch=batch, seq=seq, n_layer=1,
                         n_head=H, head_dim=D, forward_ms=t.median_ms, p20_ms=t.p20_ms,
                         p80_ms=t.p80_ms, host_ms=host, input_copies=copies, runs=t.runs,
                         retimes=t.retimes,
                         tokens_per_s=batch * seq / (t.median_ms * 1e-3),
                         tflops=flops(batch, H, seq, D, causal=True) / (by["attention"] * 1e-3) / 1e12,
                         attention_gpu_ms=by["attention"], matmul_gpu_ms=by["matmul"],
                         other_gpu_ms=by["other"], busy_gpu_ms=by["busy"],
                         attention_kernels=by["attention_kernels"], note=t.note, **env))
        log(f"  attention alone {impl:12} {dt} {layout:10} kernels {by['attention'] * 1e3:6.1f} µs "
            f"({rows[-1]['tflops']:.0f} TFLOP/s), copies {by['other'] * 1e3:5.1f} µs, wall "
            f"{t.median_ms * 1e3:6.1f} µs, host {host * 1e3:5.1f} µs, input copies {copies}")
    return rows


# --- training through a stage ---------------------------------------------------------------------

def corpus(seq, count, seed=0, device="cpu") -> torch.Tensor:
    """`count` windows of `seq` + 1 byte tokens (0..255) from text the project ships (README.md
    and the notebooks' sources, nothing downloaded), at seeded random offsets: (count, seq + 1)."""
    from . import paths
    files = [paths.ROOT / "README.md", *sorted((paths.ROOT / "notebooks" / "src").glob("*.py"))]
    data = torch.tensor(list(b"\n".join(f.read_bytes() for f in files if f.is_file())),
                        dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (count,), generator=gen)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).to(device)


TRAIN = dict(steps=300, batch=8, seq=512, n_layer=4, n_head=4, n_embd=256, lr=3e-4, seed=0)


class _Trainer:
    """One GPT-2 being fine-tuned (train()): its model, optimizer, batches and SDPA backend;
    step(i) runs step i and returns its loss and, where timed, its time in ms (CUDA events)."""

    def __init__(self, attn_implementation, backend, steps, batch, seq, n_layer, n_head, n_embd,
                 lr, seed, dtype, device, time_steps):
        from .inputs import dtype_of
        self.model = gpt2(attn_implementation, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          n_positions=seq, seed=seed, vocab_size=256, bos_token_id=0,
                          eos_token_id=0).to(device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.data = corpus(seq, steps * batch, seed=seed, device=device)
        self.batch, self.cast, self.device = batch, dtype_of(dtype), device
        self.backend = backend
        self.timed = time_steps and torch.device(device).type == "cuda"

    def _chosen(self):
        import contextlib

        from torch.nn.attention import sdpa_kernel

        from .baselines import SDPA_BACKENDS
        return sdpa_kernel(SDPA_BACKENDS[self.backend]) if self.backend else contextlib.nullcontext()

    def _autocast(self):  # fp32: none
        import contextlib
        return (torch.autocast(torch.device(self.device).type, dtype=self.cast)
                if self.cast != torch.float32 else contextlib.nullcontext())

    def step(self, i):
        x = self.data[i * self.batch:(i + 1) * self.batch]
        with self._chosen():
            if self.timed:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            with self._autocast():
                loss = self.model(x[:, :-1], labels=x[:, 1:], use_cache=False).loss
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            ms = None
            if self.timed:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
        return float(loss.detach()), ms


def trainer(attn_implementation="sdpa", backend=None, steps=TRAIN["steps"], batch=TRAIN["batch"],
            seq=TRAIN["seq"], n_layer=TRAIN["n_layer"], n_head=TRAIN["n_head"],
            n_embd=TRAIN["n_embd"], lr=TRAIN["lr"], seed=TRAIN["seed"], dtype="bf16",
            device="cuda", time_steps=True):
    """One GPT-2 set up to be fine-tuned as train() does (the same arguments), before its first
    step: .step(i) runs step i and returns (its loss, its time in ms or None). For a caller that
    does something between steps, a profiler around some of them for instance
    (tools/training_profile.py)."""
    return _Trainer(attn_implementation, backend, steps, batch, seq, n_layer, n_head, n_embd, lr,
                    seed, dtype, device, time_steps)


def _result(losses, times, batch, seq):
    step_ms = float(torch.tensor(times[10:]).median()) if len(times) > 10 else float("nan")
    return {"loss": losses, "step_ms": step_ms, "tokens_per_s": batch * seq / (step_ms * 1e-3)}


def train(attn_implementation="sdpa", backend=None, steps=TRAIN["steps"], batch=TRAIN["batch"],
          seq=TRAIN["seq"], n_layer=TRAIN["n_layer"], n_head=TRAIN["n_head"],
          n_embd=TRAIN["n_embd"], lr=TRAIN["lr"], seed=TRAIN["seed"], dtype="bf16",
          device="cuda", time_steps=True) -> dict:
    """Fine-tune a byte-level GPT-2 built from its config (head dim n_embd / n_head: 64) on
    corpus(): AdamW, fp32 weights, autocast to `dtype`, the same weights, batches and order for
    every implementation with the same seed. attn_implementation: "sdpa" (backend, e.g.
    "sdpa_flash" or "sdpa_cudnn", forces one of SDPA's kernels for forward and backward) or a
    name from register(). Returns {"loss": [per step], "step_ms": median time of a step (CUDA
    events, the steps after the first 10), "tokens_per_s"}."""
    run = trainer(attn_implementation, backend, steps, batch, seq, n_layer, n_head, n_embd, lr,
                  seed, dtype, device, time_steps)
    losses, times = [], []
    for i in range(steps):
        loss, ms = run.step(i)
        losses.append(loss)
        if ms is not None:
            times.append(ms)
    return _result(losses, times, batch, seq)


def train_in_turn(impls, steps=TRAIN["steps"], batch=TRAIN["batch"], seq=TRAIN["seq"],
                  n_layer=TRAIN["n_layer"], n_head=TRAIN["n_head"], n_embd=TRAIN["n_embd"],
                  lr=TRAIN["lr"], seed=TRAIN["seed"], dtype="bf16", device="cuda") -> list:
    """train() of several implementations at once, a step of each in turn (impls: (name,
    backend) pairs as train() takes them): every step time of one is taken beside the others',
    so a GPU's or host's drift over the run falls on all alike. One train() result each, in
    order."""
    runs = [_Trainer(name, backend, steps, batch, seq, n_layer, n_head, n_embd, lr, seed, dtype,
                     device, True) for name, backend in impls]
    losses, times = [[] for _ in runs], [[] for _ in runs]
    for i in range(steps):
        for run, ls, ts in zip(runs, losses, times):
            loss, ms = run.step(i)
            ls.append(loss)
            if ms is not None:
                ts.append(ms)
    return [_result(ls, ts, batch, seq) for ls, ts in zip(losses, times)]


# A model where attention is a larger share of a training step: sequences of 4096 bytes (the
# loss comparison's TRAIN has 512, where the step is the rest of the model's); a few steps time one.
# Batch 16, so that the GPU sets a step's time: at batch 2 the host's Python (the model's and
# the optimizer's launches) takes longer than the GPU's work, and the step times the host.
TIMED = dict(steps=30, batch=16, seq=4096, n_layer=4, n_head=8, n_embd=512)


class _NoDelta(torch.autograd.Function):
    """Attention whose backward forgets Δ: dS = P ∘ dP where FlashAttention's is P ∘ (dP − Δ),
    Δ = rowsum(dO ∘ O). The output is SDPA's; dV is right; dQ and dK are wrong by
    scale · (P ∘ Δ) K and scale · (P ∘ Δ)ᵀ Q. The backward recomputes P in fp32 (the math, no
    kernel): the training comparison's negative control (tables.CONTROL)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        import torch.nn.functional as F
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        scale = ctx.scale if ctx.scale is not None else q.shape[-1] ** -0.5
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf, dof = (t.to(work) for t in (q, k, v, do))
        s = qf @ kf.transpose(-1, -2) * scale
        if ctx.causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1),
                              float("-inf"))
        p = torch.softmax(s, dim=-1)
        ds = p * (dof @ vf.transpose(-1, -2))  # the error: - Δ left out
        return ((ds @ kf * scale).to(q.dtype), (ds.transpose(-1, -2) @ qf * scale).to(k.dtype),
                (p.transpose(-1, -2) @ dof).to(v.dtype), None, None)


def control():
    """The training comparison's negative control (tables.CONTROL): attention whose backward
    leaves Δ out of dS (_NoDelta), registered as an attention implementation; returns its name.
    A wrong backward the comparison must find. (A dQ only scaled, every gradient of W_q by one
    factor, would not do: AdamW divides each parameter's step by its gradient's own size.)"""
    from .tables import CONTROL

    def attention(q, k, v, causal=False, scale=None):
        return _NoDelta.apply(q, k, v, causal, scale)

    return register(SDPA(attention, name=CONTROL), name=CONTROL)


def training_comparison(stages=None, seeds=5, runs=1, log=print, record=True, timed=TIMED,
                        with_control=True, **kw):
    """Train the same GPT-2 (train()) from each of `seeds` seeds (TRAIN's seed and the next),
    `runs` times each, through each of SDPA's fused backends (tables.SDPA_TRAINED: flash, cuDNN,
    memory-efficient; their curves against each other are SDPA's spread: they round
    differently, and the flash backward adds dQ with atomics, so its runs differ), through each
    stage with a backward pass that runs here, and (with_control) through the negative control
    (control(): a wrong backward, which must come out outside the spread). Then, where `timed` (a
    few steps of a larger model, TIMED: attention a larger share of the step), those steps of
    every implementation but the control at once, a step of each in turn (train_in_turn), for
    the step's time. Records data/training.csv as each training ends (a row
    per implementation, seed, run and step; a configuration's old rows on this GPU go at its
    first); returns (rows, tables.training_match of the loss comparison)."""
    import pandas as pd

    from .env import environment
    from .tables import CONTROL, SDPA_TRAINED, TRAINING, training_match

    env = environment()
    impls = [(b, "sdpa", b) for b in SDPA_TRAINED]
    for st in (stages if stages is not None else [s for s in _all_stages() if s.has_backward]):
        st = _stage(st)
        why = st.unavailable()
        if why:
            log(f"{st.slug}: not trained here: {why}")
            continue
        impls.append((st.slug, register(st.slug), None))
    if with_control:
        name = control()
        impls.append((name, name, None))
    first = kw.pop("seed", TRAIN["seed"])
    todo = [(impl, seed, run, name, backend, kw) for seed in range(first, first + seeds)
            for run in range(runs) for impl, name, backend in impls]
    clocked = [(impl, name, backend) for impl, name, backend in impls if impl != CONTROL]
    if timed:  # the control's step time is no comparison
        todo += [(impl, first, 0, name, backend, {**kw, **timed}) for impl, name, backend in clocked]
    frames, cleared, in_turn = [], set(), None
    for impl, seed, run, name, backend, args in todo:
        if args is kw:
            out = train(name, backend=backend, seed=seed, **args)
        else:  # the timed steps: every implementation's at once, a step of each in turn
            if in_turn is None:
                in_turn = dict(zip([i for i, _, _ in clocked],
                                   train_in_turn([(n, b) for _, n, b in clocked], seed=seed, **args)))
            out = in_turn[impl]
        cfg = {**TRAIN, **{k: v for k, v in args.items() if k in TRAIN}, "seed": seed}
        log(f"{impl:16} seed {seed} run {run} (seq {cfg['seq']}, {cfg['steps']} steps): final "
            f"loss {out['loss'][-1]:.4f}, step {out['step_ms']:.2f} ms")
        df = pd.DataFrame([dict(impl=impl, run=run, step=i, loss=l, step_ms=out["step_ms"],
                                tokens_per_s=out["tokens_per_s"], dtype=args.get("dtype", "bf16"),
                                **cfg, **env) for i, l in enumerate(out["loss"])])
        frames.append(df)
        if record:  # as each ends: a run killed keeps what it trained
            config = tuple((k, cfg[k]) for k in ("steps", "batch", "seq", "n_layer", "n_embd"))
            old = None if config in cleared else {"gpu": env["gpu"], **dict(config)}
            cleared.add(config)
            TRAINING.upsert(df, replace=old)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return df, training_match(df)
