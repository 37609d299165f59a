"""What ncu runs: two launches of one stage (the first is skipped as a warm-up).
Usage: python -m flashlab.profile_target SLUG B H N D CAUSAL DTYPE [PASS]  (SLUG may name a
variant: 12_tma_store+ping_pong; PASS "backward": the forward with its log-sum-exp once, then
two backward passes)"""
import sys

import torch

import flashlab as fl

slug, B, H, N, D, causal, dtype = sys.argv[1:8]
pass_ = sys.argv[8] if len(sys.argv) > 8 else "forward"
cfg = fl.Config(int(B), int(H), int(N), int(D), bool(int(causal)), dtype)
if "+" in slug:  # a stage's variant: "12_tma_store+ping_pong"
    from flashlab import variants
    base, name = slug.split("+", 1)
    attn = variants.build(fl.stage(base).variant(name))
else:
    attn = fl.stage(slug).build()
q, k, v = cfg.inputs()
if pass_ == "backward":
    o, lse = attn(q, k, v, causal=cfg.causal, return_lse=True)
    do = torch.randn_like(o)
    for _ in range(2):
        attn.backward(q, k, v, o, lse, do, cfg.causal)
else:
    for _ in range(2):
        attn(q, k, v, causal=cfg.causal)
torch.cuda.synchronize()
