"""The problems flashlab times and checks, apart from how it times them (flashlab.bench): a
Config, its FLOPs as FlashAttention counts them, the teaching config and the FlashAttention
paper's sweep. Plain data: no torch import (Config.inputs makes tensors through flashlab.inputs).
"""
from dataclasses import dataclass
from typing import NamedTuple

from .dtypes import check_name

# What a row of the results table times: the forward pass, the forward that also returns the
# log-sum-exp (what training calls), or the backward (dQ, dK, dV from dO).
PASSES = ("forward", "forward_lse", "backward")
# FlashAttention's count of the backward's FLOPs: 2.5 times the forward's (five matmuls of
# 2·N²·D each against the forward's two).
BACKWARD_FLOPS = 2.5


@dataclass(frozen=True)
class Config:
    B: int
    H: int
    N: int
    D: int
    causal: bool = False
    dtype: str = "fp32"

    @property
    def flops(self) -> float:
        return flops(self.B, self.H, self.N, self.D, self.causal)

    @property
    def label(self) -> str:
        return f"B={self.B} H={self.H} N={self.N} D={self.D} {self.dtype}" + \
               (" causal" if self.causal else "")

    def inputs(self, device="cuda", seed=0):
        """Random q, k, v for this config (never zeros: they hide unwritten output)."""
        from .inputs import random_qkv
        return random_qkv(self, device, seed)


def flops(B, H, N, D, causal=False, pass_="forward") -> float:
    """FLOPs as FlashAttention counts them: the forward 4·B·H·N²·D (two matmuls of 2·N²·D each),
    the backward 2.5 times that; half of either when causal."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}; use one of {', '.join(PASSES)}")
    f = 4.0 * B * H * N * N * D * (BACKWARD_FLOPS if pass_ == "backward" else 1.0)  # lse: free
    return f / 2 if causal else f


def tflops(config: Config, ms: float, pass_="forward") -> float:
    return flops(config.B, config.H, config.N, config.D, config.causal, pass_) / (ms * 1e-3) / 1e12


# The teaching config: small enough that stage 01 runs in well under a second.
TEACHING = Config(B=4, H=16, N=1024, D=64, causal=False, dtype="fp32")


class Sweep(NamedTuple):
    tokens: int       # B·N
    width: int        # H·D
    ns: tuple         # sequence lengths
    head_dims: tuple


# The FlashAttention paper's sweep: B·N = 16k tokens, H·D = 2048, N = 512..16k, D = 64 and 128.
SWEEP = Sweep(16384, 2048, (512, 1024, 2048, 4096, 8192, 16384), (64, 128))
SWEEP_NS = SWEEP.ns


def teaching(dtype="fp32") -> Config:
    return Config(TEACHING.B, TEACHING.H, TEACHING.N, TEACHING.D, False, check_name(dtype))


def sweep(dtype="fp16", head_dims=SWEEP.head_dims):
    """The sweep's configs in `dtype`: every N, at each head dim, causal and not."""
    return [Config(SWEEP.tokens // n, SWEEP.width // d, n, d, c, check_name(dtype))
            for d in head_dims for c in (False, True) for n in SWEEP.ns]
