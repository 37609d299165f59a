"""Registers, shared memory and spills of each kernel in a stage, as ptxas reports them.

Compiles the .cu file to a cubin with `nvcc -Xptxas -v` for one architecture (no GPU needed) and
parses the report. Results are cached by the hash of the sources and flags.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from .build import NVCC_FLAGS
from .paths import KERNELS

CACHE = Path(os.environ.get("FLASHLAB_CACHE", Path.home() / ".cache" / "flashlab")) / "ptxas"


@dataclass
class KernelResources:
    kernel: str          # demangled name
    arch: str
    registers: int
    smem_static_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes


def nvcc() -> str:
    """Path of nvcc (CUDA_HOME, then PATH), or raise FileNotFoundError."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise FileNotFoundError("nvcc not found: install the CUDA toolkit or set CUDA_HOME")
    return found


def _demangle(names):
    beside_nvcc = None
    try:
        beside_nvcc = os.path.join(os.path.dirname(nvcc()), "cu++filt")
    except FileNotFoundError:
        pass
    tool = next((t for t in (shutil.which("cu++filt"), beside_nvcc, shutil.which("c++filt"))
                 if t and os.path.exists(t)), None)
    if not tool or not names:
        return list(names)
    out = subprocess.run([tool], input="\n".join(names), text=True, capture_output=True)
    lines = out.stdout.splitlines()
    return lines if out.returncode == 0 and len(lines) == len(names) else list(names)


def parse(report: str, arch: str):
    """KernelResources for every entry function in an `nvcc -Xptxas -v` report."""
    entries, props, used = [], {}, {}
    current = None
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for '(\w+)'", line):
            entries.append(m.group(1))
        elif m := re.search(r"Function properties for (\S+)", line):
            current = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            props[current] = tuple(int(g) for g in m.groups())
        elif m := re.search(r"Used (\d+) registers", line):
            smem = re.search(r"(\d+) bytes smem", line)
            used[entries[-1] if entries else current] = (int(m.group(1)), int(smem.group(1)) if smem else 0)
    # cu++filt writes template arguments as "(int)64"; c++filt as "64". Keep one spelling.
    names = [re.sub(r"\((?:unsigned )?(?:int|long|bool)\)", "", n) for n in _demangle(entries)]
    out = []
    for mangled, name in zip(entries, names):
        regs, smem = used.get(mangled, (0, 0))
        stack, st, ld = props.get(mangled, (0, 0, 0))
        out.append(KernelResources(name, arch, regs, smem, stack, st, ld))
    return out


def resources(source, arch="sm_90"):
    """ptxas's report for every kernel in `source` (a kernels/*.cu path) compiled for `arch`."""
    source = Path(source)
    flags = NVCC_FLAGS + [f"-arch={arch}", "-Xptxas", "-v", "-I", str(KERNELS)]
    digest = hashlib.sha256(repr(flags).encode())
    for p in [source, *sorted(KERNELS.glob("*.h")), *sorted(KERNELS.glob("*.cuh"))]:
        digest.update(p.read_bytes())
    cached = CACHE / f"{source.stem}-{arch}-{digest.hexdigest()[:16]}.json"
    if cached.exists():
        return [KernelResources(**d) for d in json.loads(cached.read_text())]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc(), "-cubin", *flags, str(source), "-o", os.path.join(tmp, "out.cubin")]
        proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source} for {arch}:\n{proc.stderr}")
    found = parse(proc.stdout + proc.stderr, arch)
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps([asdict(r) for r in found]))
    return found


def _first_template_arg(kernel: str):
    # demangled "kernel<64, 64, 64>(...)" or, where no demangler exists, "_Z...ILi64ELi64E..."
    m = re.search(r"<\s*(\d+)", kernel) or re.search(r"ILi(\d+)E", kernel)
    return int(m.group(1)) if m else None


def summary(source, arch="sm_90", head_dim=None) -> dict:
    """What the results table records: the kernel that runs at `head_dim` where a stage
    instantiates one per head dim (by convention D is its first template argument), else the
    worst case over the stage's kernels."""
    found = resources(source, arch)
    if head_dim is not None:
        found = [r for r in found if _first_template_arg(r.kernel) == head_dim] or found
    return {"registers": max((r.registers for r in found), default=0),
            "smem_static_bytes": max((r.smem_static_bytes for r in found), default=0),
            "spill_bytes": max((r.spill_bytes for r in found), default=0)}
