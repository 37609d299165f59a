"""Registers, shared memory and spills of each kernel in a stage, as ptxas reports them.

Compiles the .cu file to a cubin with `nvcc -Xptxas -v` for one architecture (no GPU needed) and
parses the report. Results are cached by the hash of the sources, flags and nvcc version.
compile_cubin() is the one place a stage is compiled for static inspection: flashlab.sass
disassembles the same cubin, so the SASS it counts is the code whose resources ptxas reports.
"""
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from . import build, paths
from .build import NVCC_FLAGS
from .paths import KERNELS
from .dtypes import CTYPES
from .stages import template_args  # noqa: F401 (ptxas.template_args, as before)

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
    """Path of nvcc (flashlab.build.nvcc), or raise FileNotFoundError."""
    found = build.nvcc()
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


def kernel_names(mangled):
    """Demangled names, one spelling whichever demangler is installed."""
    # cu++filt writes template arguments as "(int)64" and "(bool)0"; c++filt as "64" and
    # "false". Keep one spelling: c++filt's.
    names = [re.sub(r"\(bool\)([01])\b", lambda m: "true" if m.group(1) == "1" else "false", n)
             for n in _demangle(mangled)]
    return [re.sub(r"\((?:unsigned )?(?:int|long|bool)\)", "", n) for n in names]


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
    names = kernel_names(entries)
    out = []
    for mangled, name in zip(entries, names):
        regs, smem = used.get(mangled, (0, 0))
        stack, st, ld = props.get(mangled, (0, 0, 0))
        out.append(KernelResources(name, arch, regs, smem, stack, st, ld))
    return out


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    """nvcc's release, e.g. '13.0.88' (the whole banner if it has no V number)."""
    out = subprocess.run([nvcc(), "--version"], text=True, capture_output=True).stdout
    m = re.search(r"\bV(\d+(?:\.\d+)+)", out)
    return m.group(1) if m else out.strip()


def _flags(arch):
    # -Xptxas -v only adds the resource report; the code is that of build.py's NVCC_FLAGS. An
    # arch-specific target (sm_90a: wgmma, setmaxnreg) is named by -gencode, as build.py does.
    target = build.arch_flags(arch) if arch.endswith("a") else [f"-arch={arch}"]
    return NVCC_FLAGS + target + ["-Xptxas", "-v", "-I", str(KERNELS)]


def source_digest(source, arch) -> str:
    """Hash of our side of the cubin: the .cu file, the shared headers, the flags and arch, but
    no absolute path, so a clone anywhere agrees. Recorded beside static evidence
    (data/sass.csv) to tell when a kernel has changed since."""
    digest = hashlib.sha256(repr((NVCC_FLAGS, arch)).encode())
    for p in paths.kernel_inputs(source, KERNELS):  # the .cu, stages it includes, headers
        digest.update(p.name.encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()[:16]


def compile_digest(source, arch) -> str:
    """The cache key: source_digest plus the exact flags and the nvcc release, so that a toolkit
    upgrade is not answered from a cache the old one filled."""
    key = f"{source_digest(source, arch)} {_flags(arch)} {nvcc_version()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class Cubin:
    data: bytes      # the cubin file
    report: str      # ptxas's -v output (nvcc's stdout and stderr)


def compile_cubin(source, arch="sm_90") -> Cubin:
    """Compile `source` (a kernels/*.cu path) for `arch` with nvcc -cubin; RuntimeError on failure."""
    source = Path(source)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.cubin")
        proc = subprocess.run([nvcc(), "-cubin", *_flags(arch), str(source), "-o", out],
                              text=True, capture_output=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source} for {arch}:\n{proc.stderr}")
        return Cubin(Path(out).read_bytes(), proc.stdout + proc.stderr)


def resources(source, arch="sm_90"):
    """ptxas's report for every kernel in `source` (a kernels/*.cu path) compiled for `arch`."""
    source = Path(source)
    cached = CACHE / f"{source.stem}-{arch}-{compile_digest(source, arch)}.json"
    if cached.exists():
        return [KernelResources(**d) for d in json.loads(cached.read_text())]
    found = parse(compile_cubin(source, arch).report, arch)
    paths.write_atomic(cached, json.dumps([asdict(r) for r in found]))
    return found


def kernel_at(stage, kernels, cfg, lse=False):
    """Of `kernels` (KernelResources of the stage's .cu), the one that runs at config `cfg`: the
    template arguments its registry entry names (T, D, and for a stage with a pick() table the
    candidate pick() launches at cfg's D, mask and N) must match. LookupError if none does. lse:
    the forward asked for the log-sum-exp (a stage whose template has WITH_LSE runs another
    instantiation then)."""
    want = {"T": CTYPES[cfg.dtype], "D": str(cfg.D), "WITH_LSE": "true" if lse else "false"}
    named = _picks().launched_by_name(stage.text, stage.template, cfg.D,
                                      cfg.causal, cfg.N)
    want.update(named or {})  # what pick() launches at D, mask and N, defaults included
    want = {k: v for k, v in want.items() if k in stage.template}
    if getattr(stage, "backward", ""):  # its forward kernel, not one of its backward pass's
        kernels = [r for r in kernels if stage.is_forward(r.kernel)]
    found = [r for r in kernels if all(
        dict(zip(stage.template, template_args(r.kernel))).get(k) == v for k, v in want.items())]
    if len(found) != 1:
        names = ", ".join(r.kernel.split("(")[0] for r in kernels)
        raise LookupError(f"{stage.slug}: {len(found)} kernels match {want} at {cfg.label} "
                          f"(the kernels: {names})")
    return found[0]


def _picks():
    from . import picks  # imports the registry (and torch) only when a pick() is read
    return picks


def summary(stage, arch, cfg, lse=False) -> dict:
    """What the results table records beside a timing: ptxas's registers, static shared memory
    and spills of the kernel that runs at `cfg` (kernel_at; lse: with the log-sum-exp)."""
    r = kernel_at(stage, resources(stage.source, arch), cfg, lse=lse)
    return {"registers": r.registers, "smem_static_bytes": r.smem_static_bytes,
            "spill_bytes": r.spill_bytes}
