"""The element types flashlab's kernels take, listed once: each one's name (what the registry, the
results table and the command line say), its code in the kernel ABI (kernels/flashlab.h's
FlashlabDtype, which mirrors this table: tests/test_stages.py reads the header and checks it), the
C++ type a kernel is instantiated with (as a demangled kernel name spells it) and torch's name.

Plain data: no torch import (flashlab.inputs maps these to torch dtypes)."""
from typing import NamedTuple


class Dtype(NamedTuple):
    name: str    # "fp16"
    code: int    # FlashlabDtype value
    ctype: str   # "__half"
    torch: str   # "float16": the attribute of the torch module


DTYPES = {d.name: d for d in (
    Dtype("fp32", 0, "float", "float32"),
    Dtype("fp16", 1, "__half", "float16"),
    Dtype("bf16", 2, "__nv_bfloat16", "bfloat16"),
)}
NAMES = tuple(DTYPES)                                   # ("fp32", "fp16", "bf16")
HALF = tuple(n for n in NAMES if n != "fp32")           # what the tensor-core stages take
CTYPES = {n: d.ctype for n, d in DTYPES.items()}        # {"fp16": "__half", ...}


def check_name(name) -> str:
    """name itself if it names a dtype, else a ValueError listing the ones there are."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(NAMES)}")
    return name
