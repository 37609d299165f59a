"""What the compiler made of a stage, no GPU needed: ptxas's registers and spills, blocks per SM,
static SASS counts, single instructions, the K/V loop's body. Where nvcc or cuobjdump is missing,
the recorded counts (data/sass.csv) or one line saying what is needed."""
import contextlib
import re

import pandas as pd

from .. import ptxas, tables
from ..configs import Config, teaching
from ..stages import introduced_through
from ..stages import stage as _stage
from ..tables import NotRecorded
from .view import gpu, not_recorded, the_gpu


def _arch(st, arch):
    """`arch`, or where None the stage's own: sm_90, or sm_90a for a Hopper stage."""
    return arch or st.static_archs[-1]


def resources(stage, archs=None) -> pd.DataFrame:
    """ptxas's registers / shared memory / spills for each kernel of the stage (needs nvcc only),
    for `archs` (default: those its machine code is read for, the registry's static_archs); not
    the forward's instantiations that also write the log-sum-exp (Stage.writes_lse)."""
    st = _stage(stage)
    archs = archs or st.static_archs
    try:
        rows = [r.__dict__ | {"kernel": st.plain_name(r.kernel.split("(")[0].removeprefix("void ")),
                              "spill_bytes": r.spill_bytes}
                for a in archs for r in ptxas.resources(st.source, a)
                if not st.writes_lse(r.kernel)]
        return pd.DataFrame(rows)
    except (OSError, RuntimeError) as err:
        rec = tables.recorded(st, gpu())[["gpu", "registers", "smem_static_bytes", "spill_bytes"]]
        print(f"(nvcc unavailable: {err}; showing the recorded ptxas numbers)")
        return rec.drop_duplicates()


def blocks_per_sm(stage, smem, threads=128) -> pd.DataFrame:
    """For each head dim D of `smem` ({D: shared-memory bytes per block}): the registers ptxas
    gives the kernel the stage runs at the teaching config with that D, in its first dtype, for
    the notebook's GPU (ptxas.kernel_at), and the blocks per SM that registers, threads and
    shared memory each allow (flashlab.tiling.occupancy); `blocks` is the least of them,
    `decided_by` which."""
    from .. import tiling
    st = _stage(stage)
    cc = the_gpu().cc
    try:
        kernels = ptxas.resources(st.source, st.arch(tuple(map(int, cc.split(".")))))
    except (OSError, RuntimeError):  # no nvcc here, and the recorded rows name no kernels
        raise not_recorded(stage, " ptxas report") from None
    rows = []
    for D, nbytes in smem.items():
        cfg = teaching(st.dtypes[0])
        regs = ptxas.kernel_at(st, kernels, Config(cfg.B, cfg.H, cfg.N, D, False, cfg.dtype)).registers
        occ = tiling.occupancy(regs, int(nbytes), threads, cc)
        lim = occ["limits"]
        rows.append(dict(D=D, registers=regs, smem_bytes=int(nbytes),
                         **{f"by {k}": v for k, v in lim.items()}, blocks=occ["blocks"],
                         decided_by=min(lim, key=lim.get)))
    return pd.DataFrame(rows).set_index("D")


def instructions(stage, arch=None) -> pd.DataFrame:
    """Static SASS instruction counts by kind (flashlab.sass), a row per kernel: compiled and
    disassembled now (needs nvcc and cuobjdump, not a GPU), else as recorded in data/sass.csv.
    arch: default the stage's own (sm_90; sm_90a for a Hopper stage). Not the forward's
    instantiations that also write the log-sum-exp (Stage.writes_lse)."""
    from .. import sass
    st = _stage(stage)
    arch = _arch(st, arch)
    try:
        wide = sass.table([st.slug], arch)
        keep = [not st.writes_lse(k) for k in wide.index.get_level_values("kernel")]
        return wide[keep].rename(index=st.plain_name, level="kernel")
    except (OSError, RuntimeError) as err:
        print(f"(cuobjdump or nvcc unavailable: {err}; showing the recorded counts)")
    rec = tables.SASS.load()
    rec = rec[(rec["stage"] == st.slug) & (rec["arch"] == arch)]
    rec = rec[[not st.writes_lse(k) for k in rec["kernel"]]]
    rec = rec.assign(kernel=rec["kernel"].map(st.plain_name))
    if rec.empty:
        raise NotRecorded(f"{st.slug}: no {arch} SASS counts recorded yet: run "
                          f"`flashlab sass {st.number:02d} --record` where nvcc is installed")
    wide = rec.pivot_table(index=["stage", "kernel"], columns="category", values="count",
                           aggfunc="sum", sort=False)
    return wide[[*sass.CATEGORIES, sass.TOTAL]].astype(int).rename_axis(columns=None)


def instruction_mix(*stages, arch=None) -> pd.DataFrame:
    """instructions() of several stages in one table, a row per (stage, kernel), for a lesson to
    compare them. It keeps the categories that some kernel shown uses, or that the workbook has met
    by the last of the stages (stages.introduced_through: "no LDL" stays a row). So a table of
    stages 05 and 06 has no all-zero rows for the Hopper instructions that come later."""
    wide = pd.concat([instructions(s, arch) for s in stages])
    met = introduced_through(max((_stage(s) for s in stages), key=lambda st: st.number))
    return wide[[c for c in wide.columns if c in met or (wide[c] != 0).any()]]


@contextlib.contextmanager
def _disassembling():
    """Static SASS inspection beyond instructions()' categories is not recorded in data/: where
    nvcc or cuobjdump is missing, NotRecorded says so (and unless_missing prints it)."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        raise NotRecorded(f"this needs nvcc and cuobjdump here ({err}); data/sass.csv keeps only "
                          f"the categories that instructions() shows") from None


def _matching(kernels, pattern, slug):
    st = _stage(slug)  # the kernel without the log-sum-exp's stores, where there are both
    picked = sorted(k for k in set(kernels)
                    if not st.writes_lse(k) and re.search(pattern, st.plain_name(k)))
    if not picked:
        raise ValueError(f"{slug} has no kernel matching {pattern!r}")
    return picked[0]


def opcode_changes(stages, kernel=r"__half, 64,", arch=None) -> pd.DataFrame:
    """Static SASS counts of every opcode whose count differs between the stages' kernels (the
    first kernel of each stage whose name matches the regex `kernel`), most changed first:
    finer than instructions()' categories. Compiled and disassembled now (nvcc, cuobjdump)."""
    from .. import sass
    counts = {}
    with _disassembling():
        for name in stages:
            st = _stage(name)
            mix = sass.instruction_mix(st.source, _arch(st, arch))
            counts[st.slug] = mix[mix["kernel"] == _matching(mix["kernel"], kernel, st.slug)] \
                .set_index("opcode")["count"]
    table = pd.DataFrame(counts).fillna(0).astype(int)
    table = table[table.nunique(axis=1) > 1]
    spread = table.max(axis=1) - table.min(axis=1)
    return table.loc[spread.sort_values(ascending=False, kind="stable").index].rename_axis("opcode")


def sass_lines(stage, pattern, kernel=r"__half, 64,", arch=None) -> list:
    """The machine instructions of a stage's kernel (the first whose name matches the regex
    `kernel`) that match the regex `pattern`, as cuobjdump writes them, without the encodings:
    ['/*0660*/ LDGSTS.E.BYPASS.128 [R21], desc[UR6][R10.64], !P0 ;', ...]."""
    from .. import sass
    st = _stage(stage)
    with _disassembling():
        text = sass.disassemble(st.source, _arch(st, arch))
    parts = re.split(r"^\s*Function\s*:\s*", text, flags=re.M)[1:]
    names = map(sass.short_name, ptxas.kernel_names([p.split(None, 1)[0] for p in parts]))
    bodies = dict(zip(names, parts))
    lines = []
    for line in bodies[_matching(bodies, kernel, st.slug)].splitlines():
        m = re.match(r"\s*(/\*[0-9a-f]+\*/)\s+([^;]*;)", line)
        if m and re.search(pattern, m.group(2)):
            lines.append(f"{m.group(1)} {' '.join(m.group(2).split())}")
    return lines


def loop_bodies(stages, kernel=r"__half, 64,", arch=None) -> pd.DataFrame:
    """The K/V loop of each stage's kernel (the first matching the regex `kernel`), read off its
    machine code (flashlab.sass.kv_loops: the loop with the most HMMA or HGMMA, the shortest of
    those): instructions in one trip and the categories among them, a row per stage; categories
    that are 0 everywhere left out."""
    from .. import sass
    rows = {}
    with _disassembling():
        for name in stages:
            st = _stage(name)
            found = sass.loops(st.source, _arch(st, arch))
            chosen = _matching(found["kernel"], kernel, st.slug)
            rows[st.slug] = sass.kv_loops(found).loc[chosen].rename(None)
            rows[st.slug]["kernel"] = st.plain_name(chosen)
    table = pd.DataFrame(rows).T.drop(columns=["first", "last"])
    kernel_col = table.pop("kernel")
    table = table.astype(int)
    table = table.loc[:, (table != 0).any()]
    table.insert(0, "kernel", kernel_col)
    return table.rename_axis("stage")


