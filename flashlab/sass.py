"""Which machine instructions each stage compiles to: static SASS evidence for its technique.

A stage's idea should be visible in its code before it is visible in a timing: float4 loads show
up as LDG.E.128 and LDS.128, warp reductions as SHFL, spills as LDL/STL, tensor cores as HMMA.
This module compiles a stage exactly as flashlab.ptxas does (one cubin, no GPU needed),
disassembles it with `cuobjdump -sass` and counts opcodes per kernel.

All counts are STATIC: how many times an instruction appears in the code, not how many times it
executes. A loop body counts once however often it runs, and the compiler's copies of a path
(unrolled loops, the divergent fallback of a warp shuffle) each count. Read them as present or
absent, and as rough proportions; executed counts come from a profiler (flashlab.profile).
"""
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd

from . import paths, ptxas
from .tables import SASS

CACHE = ptxas.CACHE.parent / "sass"
PIP_PACKAGES = "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"

# The groups the workbook talks about, in the order tables show them: name -> what it means.
CATEGORIES = {
    "HMMA": "tensor-core matrix multiply-accumulate (mma.sync)",
    "HGMMA": "warpgroup tensor-core matrix multiply-accumulate (wgmma.mma_async, sm_90a)",
    "LDSM": "ldmatrix: shared memory to registers in tensor-core fragment layout",
    "LDGSTS": "cp.async: global to shared memory without passing through registers",
    "UTMALDG": "cp.async.bulk.tensor: a TMA copy of a whole box, global to shared memory",
    "UTMASTG": "cp.async.bulk.tensor: a TMA copy of a whole box, shared to global memory",
    "UBLKCP": "cp.async.bulk: a 1-D bulk copy of contiguous bytes by the TMA, no tensor map",
    "UBLKRED": "cp.reduce.async.bulk: contiguous bytes of shared memory added into global memory "
               "by the TMA",
    "SYNCS": "mbarrier operations (init, arrive, expect_tx, try_wait on a phase)",
    "USETMAXREG": "setmaxnreg: a warpgroup gives registers back to the SM or takes more",
    "LDG.E.128": "16-byte global loads (float4)",
    "LDG": "narrower global loads (4 or 8 bytes)",
    "STG": "global stores, any width",
    "RED": "reductions to global memory (an atomicAdd whose old value is not used)",
    "ATOM": "atomics on global memory that return the old value (atomicExch, atomicAdd used)",
    "MEMBAR": "memory fences (__threadfence): earlier writes visible GPU-wide before later ones",
    "LDS.128": "16-byte shared-memory loads (float4)",
    "LDS": "narrower shared-memory loads",
    "STS": "shared-memory stores, any width",
    "LDL": "local-memory loads: spills (or arrays the compiler could not keep in registers)",
    "STL": "local-memory stores: spills (or such arrays)",
    "MUFU.EX2": "hardware 2^x, what __expf becomes",
    "FFMA": "fp32 fused multiply-add, any rounding mode",
    "SHFL": "warp shuffles (reductions across lanes)",
    "BAR": "block-wide barriers (__syncthreads)",
    "R2UR": "a move into a uniform register (one value for the whole warp), which wgmma's "
            "descriptors and TMA's coordinates are read from",
}
TOTAL = "total"  # every instruction of the kernel, padding NOPs included


def category(opcode: str):
    """The CATEGORIES group an opcode (with modifiers, e.g. 'LDG.E.128') belongs to, or None.
    Grouped by the base opcode, except where the workbook cares about a modifier (width, EX2);
    HFMA2.MMA is not HMMA: ptxas uses it as a register move."""
    base, *mods = opcode.split(".")
    if base in ("LDG", "LDS"):  # 'LDG.E.128', 'LDS.128', 'LDS.U.128': split off the 16-byte ones
        return {"LDG": "LDG.E.128", "LDS": "LDS.128"}[base] if "128" in mods else base
    if base == "MUFU":
        return opcode if opcode == "MUFU.EX2" else None
    if base == "REDG":  # sm_90's name for RED (sm_80) on global memory
        return "RED"
    if base == "ATOMG":  # and for ATOM
        return "ATOM"
    return base if base in CATEGORIES else None


# --- the tools -------------------------------------------------------------------------------------

def _pip_bins(tool):
    # The wheels put the tool in site-packages/nvidia/<cuNN or cuda_tool>/bin/, depending on release.
    for entry in sys.path:
        yield from sorted(Path(entry or ".").glob(f"nvidia/*/bin/{tool}"))


def _find(tool):
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates = [os.path.join(h, "bin", tool) for h in homes if h]
    try:
        candidates.append(os.path.join(os.path.dirname(ptxas.nvcc()), tool))
    except FileNotFoundError:
        pass
    candidates += [shutil.which(tool), *map(str, _pip_bins(tool))]
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


def cuobjdump() -> str:
    """Path of cuobjdump: CUDA_HOME/bin, beside nvcc, PATH, then the pip wheel; else
    FileNotFoundError."""
    found = _find("cuobjdump")
    if not found:
        raise FileNotFoundError(f"cuobjdump not found (looked in CUDA_HOME/bin, beside nvcc, on "
                                f"PATH and in pip's nvidia/*/bin): pip install {PIP_PACKAGES}")
    return found


def _nvdisasm_env(tool):
    # cuobjdump -sass runs nvdisasm, looking beside itself and on PATH; point it at ours otherwise.
    env = dict(os.environ)
    beside = os.path.join(os.path.dirname(tool), "nvdisasm")
    found = beside if os.path.isfile(beside) else _find("nvdisasm")
    if found:
        env["NVDISASM_PATH"] = os.path.dirname(found)
    return env


@functools.lru_cache(maxsize=None)
def _version(tool) -> str:
    out = subprocess.run([tool, "--version"], text=True, capture_output=True).stdout
    m = re.search(r"\bV(\d+(?:\.\d+)+)", out)
    return m.group(1) if m else out.strip()


# --- disassembly -----------------------------------------------------------------------------------

def _source(source) -> Path:
    """A kernels/*.cu path from a path, a Stage or a stage key ('03', 3, '03_coarsened')."""
    if isinstance(source, (str, Path)) and str(source).endswith(".cu"):
        return Path(source)
    from .stages import stage  # imports torch; only needed for a stage key
    return stage(source).source


def disassemble(source, arch="sm_90") -> str:
    """`cuobjdump -sass` of `source` (a .cu path or a stage) compiled as flashlab.ptxas compiles it,
    cached by the hash of the sources, flags, nvcc and cuobjdump releases."""
    source = _source(source)
    tool = cuobjdump()
    key = hashlib.sha256(f"{ptxas.compile_digest(source, arch)} {_version(tool)}".encode())
    cached = CACHE / f"{source.stem}-{arch}-{key.hexdigest()[:16]}.sass"
    if cached.exists():
        return cached.read_text()
    cubin = ptxas.compile_cubin(source, arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{source.stem}.cubin")
        Path(path).write_bytes(cubin.data)
        proc = subprocess.run([tool, "-sass", path], text=True, capture_output=True,
                              env=_nvdisasm_env(tool))
    if proc.returncode != 0 or "Function :" not in proc.stdout:
        raise RuntimeError(f"cuobjdump -sass failed on {source} for {arch}:\n{proc.stderr}")
    paths.write_atomic(cached, proc.stdout)
    return proc.stdout


# An instruction line: "/*0a30*/  @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;" -> "LDG.E.128".
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
                          r"([^;]*)")
_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")


_ADDRESS = re.compile(r"^\s*/\*([0-9a-f]+)\*/")
_BRANCH_TARGET = re.compile(r"\bBRA\b[^;]*?\b0x([0-9a-f]+)\s*;")


class Instruction(NamedTuple):
    address: int
    opcode: str
    operands: tuple  # their text, e.g. ("R12", "[R3+0x400]")
    target: Optional[int]  # a branch's target address, else None


def listing(sass: str) -> dict:
    """{mangled kernel name: [Instruction]} from cuobjdump -sass text, an entry per instruction."""
    out, current = {}, None
    for line in sass.splitlines():
        if m := _FUNCTION.match(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            target = _BRANCH_TARGET.search(line)
            current.append(Instruction(int(_ADDRESS.match(line).group(1), 16), m.group(1),
                                       tuple(o.strip() for o in m.group(2).split(",") if o.strip()),
                                       int(target.group(1), 16) if target else None))
    return out


def parse(sass: str) -> dict:
    """{mangled kernel name: Counter of opcodes} from cuobjdump -sass text."""
    return {k: Counter(i.opcode for i in ins) for k, ins in listing(sass).items()}


def short_name(demangled: str) -> str:
    """'void coarsened_kernel<64, 64, 64>(const float *, ...)' -> 'coarsened_kernel<64, 64, 64>':
    the same whichever demangler (or none) wrote it, so recorded rows compare across machines."""
    name = re.sub(r"^void\s+", "", demangled)
    return name.split("(", 1)[0].strip() or demangled


def _kernels(source, arch):
    counts = parse(disassemble(source, arch))
    return dict(zip(map(short_name, ptxas.kernel_names(list(counts))), counts.values()))


def _pick(kernels: dict, kernel):
    if kernel is None:
        return kernels
    if kernel not in kernels:
        raise ValueError(f"no kernel {kernel!r}; this stage has {', '.join(kernels)}")
    return {kernel: kernels[kernel]}


def instruction_mix(source, arch="sm_90", kernel=None) -> pd.DataFrame:
    """Static opcode counts: one row per (kernel, opcode with modifiers), with its CATEGORIES group
    (None for the rest), most frequent first. Instructions in the code, not executed."""
    rows = [dict(kernel=k, opcode=op, category=category(op), count=n)
            for k, ops in _pick(_kernels(source, arch), kernel).items() for op, n in ops.items()]
    df = pd.DataFrame(rows, columns=["kernel", "opcode", "category", "count"])
    return df.sort_values(["kernel", "count", "opcode"], ascending=[True, False, True],
                          ignore_index=True)


def grouped(source, arch="sm_90", kernel=None) -> pd.DataFrame:
    """Static counts per (kernel, category): every CATEGORIES group, zeros included, then TOTAL."""
    rows = []
    for k, ops in _pick(_kernels(source, arch), kernel).items():
        by_cat = Counter()
        for op, n in ops.items():
            by_cat[category(op)] += n
        rows += [dict(kernel=k, category=c, count=by_cat[c]) for c in CATEGORIES]
        rows.append(dict(kernel=k, category=TOTAL, count=sum(ops.values())))
    return pd.DataFrame(rows, columns=["kernel", "category", "count"])


def _code(source, arch, kernel=None) -> dict:
    """{short kernel name: [Instruction]} of a stage's machine code (one kernel, if named)."""
    code = listing(disassemble(_source(source), arch))
    return _pick(dict(zip(map(short_name, ptxas.kernel_names(list(code))), code.values())), kernel)


def group_waits(source, arch="sm_90a", kernel=None) -> pd.DataFrame:
    """How each kernel waits for its wgmma groups: a row per kernel, the number of
    `wgmma.wait_group N` it holds (WARPGROUP.DEPBAR.LE gsb0, N) with N = 0 (every group done:
    the tensor cores have nothing left queued) and with N >= 1 (some still running while the
    warpgroup goes on: products overlapped with what follows)."""
    rows = []
    for name, ins in _code(source, arch, kernel).items():
        waits = [int(i.operands[-1], 0) for i in ins
                 if i.opcode == "WARPGROUP.DEPBAR.LE" and i.operands[:1] == ("gsb0",)]
        rows.append(dict(kernel=name, all_done=sum(n == 0 for n in waits),
                         some_running=sum(n > 0 for n in waits)))
    return pd.DataFrame(rows, columns=["kernel", "all_done", "some_running"]).set_index("kernel")


def _back_branches(ins):
    """(address, target) of each branch back to an earlier address: the end and start of a loop
    (a branch to itself, the trap after EXIT, is not one)."""
    return [(i.address, i.target) for i in ins if i.target is not None and i.target < i.address]


def loops(source, arch="sm_90", kernel=None) -> pd.DataFrame:
    """The loops of each kernel as the machine code has them: a branch back to an earlier address
    closes one (a branch to itself, the trap after EXIT, does not). A row per (kernel, loop): its
    first and last address, the instructions in its body and the CATEGORIES counts among them,
    i.e. what one trip costs, statically (a loop nested in another counts in both)."""
    rows = []
    for name, ins in _code(source, arch, kernel).items():
        for address, target in _back_branches(ins):
            body = Counter(category(i.opcode) for i in ins if target <= i.address <= address)
            rows.append(dict(kernel=name, first=hex(target), last=hex(address),
                             instructions=sum(body.values()), **{c: body[c] for c in CATEGORIES}))
    return pd.DataFrame(rows, columns=["kernel", "first", "last", "instructions", *CATEGORIES])


def kv_loops(found: pd.DataFrame) -> pd.DataFrame:
    """The K/V loop of each kernel among `loops()` rows: the loop with the most tensor-core
    instructions (HMMA + HGMMA) and, of those, the fewest instructions -- a loop around it (the
    work items, say) holds the same products and more. A row per kernel, indexed by kernel."""
    mma = found.assign(mma=found["HMMA"] + found["HGMMA"])
    mma = mma[mma["mma"] > 0].sort_values(["mma", "instructions"], ascending=[False, True])
    return mma.drop_duplicates("kernel").drop(columns="mma").set_index("kernel")


def evidence(stage, arch="sm_90") -> pd.DataFrame:
    """Which categories appear in the code of each of the stage's kernels: a bool table, one row
    per kernel, one column per category. `.all()` = in every kernel, `.any()` = in some."""
    g = grouped(stage, arch)
    g = g[g["category"] != TOTAL]
    table = g.pivot(index="kernel", columns="category", values="count")[list(CATEGORIES)] > 0
    table.columns.name = None
    return table


def for_arch(stages, arch) -> list:
    """Of `stages`, those whose machine code is read for `arch` (the registry's static_archs):
    the Hopper stages only for sm_90a, the others for sm_80 and sm_90."""
    return [st for st in stages if arch in st.static_archs]


def table(stages=None, arch="sm_90") -> pd.DataFrame:
    """Wide view for printing: a row per (stage, kernel), a column per category plus TOTAL."""
    from .stages import stages as all_stages
    from .stages import stage as get
    chosen = [get(s) for s in stages] if stages else for_arch(all_stages(), arch)
    parts = [grouped(st.source, arch).assign(stage=st.slug) for st in chosen]
    wide = pd.concat(parts).pivot_table(index=["stage", "kernel"], columns="category",
                                        values="count", aggfunc="sum", sort=False)
    wide = wide[[*CATEGORIES, TOTAL]].astype(int)
    wide.columns.name = None
    return wide


# --- data/sass.csv (flashlab.tables.SASS) ---------------------------------------------------------

def rows(stages=None, arch="sm_90") -> pd.DataFrame:
    """What record() writes: tidy rows with what made them (source hash, nvcc, commit)."""
    from .env import commit
    from .stages import stages as all_stages
    from .stages import stage as get
    chosen = [get(s) for s in stages] if stages else for_arch(all_stages(), arch)
    parts = [grouped(st.source, arch).assign(stage=st.slug, arch=arch,
                                             source_hash=ptxas.source_digest(st.source, arch))
             for st in chosen]
    df = pd.concat(parts, ignore_index=True)
    df["nvcc"], df["cuobjdump"], df["commit"] = ptxas.nvcc_version(), _version(cuobjdump()), commit()
    return df[SASS.columns]


def record(arch="sm_90", stages=None):
    """Write the grouped counts to data/sass.csv. Re-recording replaces every earlier row of the
    same arch (and stages), so a renamed kernel leaves no stale rows behind. Refuses a checkout
    whose tracked code is uncommitted: a row naming a '-dirty' commit names no code anyone can
    check out, and recording again after the commit takes seconds."""
    from .env import commit
    if commit().endswith("-dirty"):
        raise ValueError(f"the checkout has uncommitted code ({commit()}): commit it, then record "
                         "the SASS, so each row names a commit anyone can check out")
    new = rows(stages, arch)
    drop = {"arch": arch}
    if stages:
        drop["stage"] = sorted(set(new["stage"]))
    SASS.upsert(new, replace=drop)
    return SASS.path()


# --- how far ahead loads are scheduled ------------------------------------------------------------

_REG = re.compile(r"(?<![\w.])R(\d+)\b")


def _regs(opcode, position, operand):
    """The registers an operand names: HMMA.16816 reads A as 4, B as 2, C as 4; LDSM .x4 writes 4."""
    m = _REG.search(operand)
    if not m or operand.lstrip().startswith("["):
        return set(int(r) for r in _REG.findall(operand))  # an address: its base register(s)
    width = 1
    if opcode.startswith("HMMA.16816"):
        width = (4, 4, 2, 4)[position] if position < 4 else 1
    elif opcode.startswith("LDSM") and position == 0:
        width = 4 if opcode.endswith(".4") else 2 if opcode.endswith(".2") else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def load_use(source, kernel, arch="sm_90", opcode="LDSM") -> pd.DataFrame:
    """Every `opcode` load in the kernel's longest loop, as ptxas scheduled it: how many
    instructions, and how many of them HMMA, issue between the load and the first instruction that
    reads a register it wrote (following the loop around to its start if the use is in the next
    trip). Many HMMA in between = the load's latency is hidden behind tensor-core work already,
    which is what register double-buffering in the source would arrange."""
    ins = _code(source, arch, kernel)[kernel]
    if not _back_branches(ins):
        raise ValueError(f"{kernel}: no loop in the machine code")
    last, first = max(_back_branches(ins), key=lambda b: b[0] - b[1])
    body = [i for i in ins if first <= i.address <= last]
    rows = []
    for k, load in enumerate(body):
        if not load.opcode.startswith(opcode) or not load.operands:
            continue
        wrote = _regs(load.opcode, 0, load.operands[0])
        order = body[k + 1:] + body[:k]  # on to the loop's end, then around from its start
        for n, i in enumerate(order):
            if any(_regs(i.opcode, p, o) & wrote for p, o in enumerate(i.operands)
                   if p > 0 or i.opcode.startswith("ST")):
                rows.append(dict(address=hex(load.address), opcode=load.opcode, instructions=n,
                                 hmma=sum(x.opcode.startswith("HMMA") for x in order[:n]),
                                 next_trip=n >= len(body) - k - 1))
                break
    return pd.DataFrame(rows, columns=["address", "opcode", "instructions", "hmma", "next_trip"])
