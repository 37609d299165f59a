"""B*H past 65535, the most a grid's y dimension holds: PyTorch's attention runs B*H = 70 000, so
every stage must too (each launches a 1-D grid: a block per head, or per query tile and head)."""
import pytest
import torch

import flashlab as fl
from flashlab.check import tolerance
from flashlab.inputs import dtype_of

pytestmark = pytest.mark.gpu

# (B, H, N, causal): 70 000 heads in one batch with a ragged N, and B*H = 70 000 with N = 1.
SHAPES = [(1, 70000, 17, False), (700, 100, 1, False), (1, 70000, 17, True)]


@pytest.mark.parametrize("B, H, N, causal", SHAPES)
@pytest.mark.parametrize("st", fl.stages(), ids=lambda st: st.slug)
def test_many_heads(st, B, H, N, causal):
    if causal and not st.causal:
        pytest.skip(f"{st.slug} has no causal mask")
    dtype = dtype_of(st.dtypes[0])
    q, k, v = (torch.randn(B, H, N, 64, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.full_like(q, float("nan"))  # a block that never runs leaves NaN behind
    st.build()(q, k, v, causal=causal, out=out)
    ref = fl.reference(q, k, v, causal=causal)
    assert fl.rel_err(out, ref) <= tolerance(q, k, v, causal, ref)
