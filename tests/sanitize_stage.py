"""Run one stage on small shapes; tests/test_gpu.py runs this under compute-sanitizer."""
import sys

import torch

import flashlab as fl
from flashlab.inputs import dtype_of

st = fl.stage(sys.argv[1])
attn = st.build()
for dt in st.dtypes:
    for N, D in ((17, 64), (70, 128), (1, 64)):
        if D not in st.head_dims:
            continue
        for causal in (False, True):
            q, k, v = (torch.randn(1, 2, N, D, device="cuda", dtype=dtype_of(dt)) for _ in range(3))
            attn(q, k, v, causal=causal)
torch.cuda.synchronize()
print("done")
