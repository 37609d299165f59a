"""Run one stage on small shapes; tests/test_gpu.py runs this under compute-sanitizer."""
import sys

import torch

import flashlab as fl
from flashlab import picks

st = fl.stage(sys.argv[1])
attn = st.build()
dtype = fl.inputs.dtype_of(st.dtypes[0])
# 300 keys: several K/V tiles, so the pipelines (and stage 10's mbarrier ring) wrap
for N, D in ((17, 64), (70, 128), (1, 64), (300, 64), (300, 128)):
    if D not in st.head_dims:
        continue
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, N, D, device="cuda", dtype=dtype) for _ in range(3))
        attn(q, k, v, causal=causal)
        if st.lse:  # and the kernel that also writes the log-sum-exp
            attn(q, k, v, causal=causal, return_lse=True)
# every other shape pick() launches, at a ragged length past each boundary (one head: the tools
# slow each access down)
for D, causal, N in picks.boundary_probes(st.source.read_text())[1::2]:
    q, k, v = (torch.randn(1, 1, N, D, device="cuda", dtype=dtype) for _ in range(3))
    attn(q, k, v, causal=causal)
# a stage with a backward pass: the forward with its log-sum-exp, then the backward
if st.has_backward:
    for N, D in ((17, 64), (70, 128), (1, 64), (300, 64), (300, 128)):
        if D not in st.head_dims:
            continue
        for causal in (False, True):
            q, k, v, do = (torch.randn(1, 2, N, D, device="cuda", dtype=dtype) for _ in range(4))
            o, lse = attn(q, k, v, causal=causal, return_lse=True)
            attn.backward(q, k, v, o, lse, do, causal)
    torch.cuda.synchronize()
    print("backward done")
torch.cuda.synchronize()
print("done")
