"""Baselines measured in the same run as the stages: PyTorch SDPA's own backends, forced one at a
time, and a plain PyTorch attention (matmul, softmax, matmul)."""
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from .reference import naive_attention

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}
NAMES = (*SDPA_BACKENDS, "torch_naive")
# The backends the stages are compared with over the sweep, timed in turn with them at each config.
COMPARED = ("sdpa_flash", "sdpa_cudnn")


class Baseline:
    """attn(q, k, v, causal=False, out=None, scale=None) through one PyTorch implementation."""

    def __init__(self, name):
        if name not in NAMES:
            raise ValueError(f"no baseline {name!r}; the baselines are {', '.join(NAMES)}")
        self.name = name
        self.__name__ = name

    def __repr__(self):
        return f"<flashlab baseline {self.name}>"

    def __call__(self, q, k, v, causal=False, out=None, scale=None):
        if self.name == "torch_naive":
            o = naive_attention(q, k, v, causal, scale)
        else:
            with sdpa_kernel(SDPA_BACKENDS[self.name]):
                o = scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        if out is not None:
            out.copy_(o)
            return out
        return o


def baselines():
    return [Baseline(n) for n in NAMES]
