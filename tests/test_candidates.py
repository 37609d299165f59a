"""Kernel candidates in tools/candidates/ (measured, not stages), each kept as a patch on the stage
it was written for, still apply to that stage and build for Hopper at the shapes their README
reports, without ptxas serializing wgmma (C75xx) or spilling."""
import re
import shutil
import subprocess

import pytest

from conftest import load_tool, needs_nvcc
from flashlab import paths, ptxas
from flashlab.stages import stage

hopper_try = load_tool("hopper_try")

CANDIDATES = paths.ROOT / "tools" / "candidates"
# Each candidate: the stage its patch applies to, and the shapes tools/candidates/README.md reports.
PATCHES = {
    "12_poly_exp2.patch": ("12_tma_store", ["D64:128,3,2,4;D128:128,2,2,4",
                                            "D64:128,3,2,2;D128:128,2,2,8"]),
    "11_past_end.patch": ("11_warpspec", ["D64:128,4,3;D64c:64,4,2,2;D128:128,2,2",
                                          "D64:128,4,3;D128:128,2,2"]),
}



def test_every_candidate_has_its_shapes_and_readme_entry():
    """A candidate is a patch on its stage, not a copy of the stage's file (the probes, which are
    no kernels of a stage, are the only .cu files here)."""
    readme = (CANDIDATES / "README.md").read_text()
    assert not sorted(p.name for p in CANDIDATES.glob("*.cu")), \
        "keep a candidate as a patch on its stage: diff -u kernels/NN_slug.cu candidate.cu"
    assert sorted(p.name for p in CANDIDATES.glob("*.patch")) == sorted(PATCHES)
    for name in PATCHES:
        assert f"`{name}`" in readme


@needs_nvcc
@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch program")
@pytest.mark.parametrize("name,shape", [(n, s) for n, (_, shapes) in PATCHES.items() for s in shapes])
def test_a_patch_candidate_applies_and_builds_for_hopper(tmp_path, name, shape):
    """The patch still applies to its stage, and the kernel it makes builds as the README says."""
    slug, _ = PATCHES[name]
    out = tmp_path / name.replace(".patch", ".cu")
    subprocess.run(["patch", "-s", "-o", str(out), str(stage(slug).source), str(CANDIDATES / name)],
                   check=True)
    st = hopper_try.unregistered_stage(out)
    out.write_text(hopper_try.variant_source(st, shape, out.read_text()))
    cubin = ptxas.compile_cubin(out, "sm_90a")
    assert not re.search(r"C75\d\d", cubin.report), cubin.report
    found = ptxas.parse(cubin.report, "sm_90a")
    assert found and all(r.spill_bytes == 0 for r in found), found


@needs_nvcc
@pytest.mark.parametrize("probe", sorted(p.name for p in (CANDIDATES / "probes").glob("*.cu")))
def test_a_probe_builds_for_hopper(tmp_path, probe):
    """The standalone probes beside the candidates (their own main, no flashlab headers) build
    with nvcc for sm_90a as their header comment says."""
    proc = subprocess.run([ptxas.nvcc(), "-O3", "-gencode", "arch=compute_90a,code=sm_90a",
                           "-o", str(tmp_path / "probe"), str(CANDIDATES / "probes" / probe)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
