"""Compile without a GPU: every stage through nvcc/ptxas for sm_80 and sm_90 (a Hopper stage for
its one target, sm_90a, where ptxas must not warn that it serialized the wgmma), the generated
pybind11 binding through g++, and a broken kernel's error pointing at the real .cu file and line."""
import importlib
import shutil
import subprocess
import sysconfig

import pytest

import flashlab as fl
from flashlab import build, measure, picks, ptxas, tables
from flashlab.dtypes import CTYPES
from flashlab.paths import KERNELS

from conftest import NVCC, needs_nvcc
GXX = shutil.which("g++")

STAGES = [st.slug for st in fl.stages()]
# (stage, architecture) pairs its machine code is read for (the registry's static_archs)
BUILDS = [(st.slug, arch) for st in fl.stages() for arch in st.static_archs]


@needs_nvcc
@pytest.mark.parametrize("slug, arch", BUILDS)
def test_stage_compiles_without_spills(slug, arch):
    st = fl.stage(slug)
    found = ptxas.resources(st.source, arch)
    assert len(found) >= 1, f"ptxas reported no kernel in {slug}"
    for k in found:
        assert k.arch == arch
        assert 0 < k.registers <= 255, k
        assert k.spill_bytes == 0, f"{slug} spills on {arch}: {k}"
        assert k.stack_bytes == 0, f"{slug} uses a stack frame on {arch}: {k}"
        assert ptxas.template_args(k.kernel) == [] or not st.is_forward(k.kernel) or \
            len(ptxas.template_args(k.kernel)) == len(st.template), (k.kernel, st.template)


@needs_nvcc
@pytest.mark.parametrize("slug", STAGES)
def test_the_registers_recorded_are_those_of_the_kernel_that_runs(slug):
    """The README showed 237 / 242 / 246 registers for 05 / 06 / 07 at the teaching config
    (D = 64, fp16): the D = 128 kernels'. summary() picks the kernel by the template arguments
    the registry names (element type, head dim, and for a tuned stage what pick() launches)."""
    st = fl.stage(slug)
    h100 = st.arch((9, 0))  # sm_90, or sm_90a for a Hopper stage
    found = ptxas.resources(st.source, h100)
    for cfg in measure.configs_for(st):
        k = ptxas.kernel_at(st, found, cfg)
        args = dict(zip(st.template, ptxas.template_args(k.kernel)))
        assert args.get("D", str(cfg.D)) == str(cfg.D), (k.kernel, cfg.label)
        assert args.get("T", CTYPES[cfg.dtype]) == CTYPES[cfg.dtype], (k.kernel, cfg.label)
        assert ptxas.summary(st, h100, cfg) == {
            "registers": k.registers, "smem_static_bytes": k.smem_static_bytes, "spill_bytes": 0}
    # A kernel that moves registers between warpgroups (setmaxnreg) reports its cap at entry,
    # the same at every head dim.
    if ("D" in st.template and not st.picks and st.dtypes != ("fp32",)
            and not st.sass_evidence.get("USETMAXREG")):
        small, big = (ptxas.summary(st, h100, fl.Config(4, 16, 1024, d, False, "fp16"))
                      for d in (64, 128))
        assert small["registers"] < big["registers"], (slug, small, big)


@needs_nvcc
def test_the_tuned_stage_reports_the_shape_pick_launches():
    st = next(s for s in fl.stages() if s.picks)
    found = ptxas.resources(st.source, "sm_90")
    for (D, causal), segs in picks.read_by_n().items():
        for below, c in segs:
            N = below // 2 if below else 16384
            k = ptxas.kernel_at(st, found, fl.Config(1, 1, N, D, causal, "fp16"))
            assert k.kernel.split("(")[0].removeprefix("void ") == picks.kernel_name(D, c)


@needs_nvcc
def test_recorded_registers_match_the_kernels_as_they_are():
    """Every stage row recorded on the GPU shown at a standard config carries ptxas's numbers
    for the kernel that ran there, compiled from today's sources."""
    gpu = tables.gpu_shown()
    rows = tables.ok(tables.recorded(gpu=gpu))
    rows = rows[rows["kind"] == "stage"]
    checked = 0
    for st in fl.stages():
        mine = rows[rows["stage"] == st.slug]
        for cfg in measure.configs_for(st):
            at = tables.at_config(mine, cfg)
            if at.empty:
                continue
            arch = st.arch(tuple(int(x) for x in str(at["compute_capability"].iloc[0]).split(".")))
            want = ptxas.summary(st, arch, cfg)["registers"]
            assert at["registers"].iloc[0] == want, \
                f"{st.slug} at {cfg.label} on {gpu}: recorded {at['registers'].iloc[0]}, ptxas {want}"
            checked += 1
    assert checked, f"no stage rows recorded on {gpu}"


@needs_nvcc
@pytest.mark.parametrize("slug", STAGES)
def test_stage_builds_for_the_oldest_gpu_it_claims(slug, tmp_path, monkeypatch):
    st = fl.stage(slug)
    arch = st.arch(st.min_cc)
    monkeypatch.setattr(ptxas, "CACHE", tmp_path)
    try:
        found = ptxas.resources(st.source, arch)
    except RuntimeError as err:
        if "Unsupported gpu architecture" in str(err):
            pytest.skip(f"this nvcc does not build for {arch}")
        raise
    assert found


# ptxas's warnings that the code it emits is not the code the source asks for: wgmma serialized
# because ordinary instructions touch its accumulators (C7515 and its neighbours), registers the
# wgmma pipeline needs not available (C7510, C7511), setmaxnreg ignored (C7508).
PIPELINE_WARNINGS = ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515", "C7516",
                     "C7517", "C7518", "C7519", "C7520")


@needs_nvcc
@pytest.mark.parametrize("slug", [st.slug for st in fl.stages() if st.arch_specific])
def test_hopper_stages_compile_without_ptxas_warnings(slug):
    st = fl.stage(slug)
    report = ptxas.compile_cubin(st.source, st.static_archs[0]).report
    warnings = [ln for ln in report.splitlines() if "warning" in ln.lower()]
    assert not warnings, f"{slug}: ptxas warned:\n" + "\n".join(warnings)
    assert not any(code in report for code in PIPELINE_WARNINGS), report


def test_pipeline_warnings_are_caught_on_canned_text():
    canned = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
              "serialized due to the presence of Extern calls in the function")
    assert any(code in canned for code in PIPELINE_WARNINGS)


@needs_nvcc
def test_results_are_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(ptxas, "CACHE", tmp_path / "ptxas")
    src = fl.stage(1).source
    first = ptxas.resources(src, "sm_80")
    cached = list((tmp_path / "ptxas").glob("01_naive-sm_80-*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(ptxas, "nvcc", lambda: pytest.fail("the cached report was not used"))
    assert ptxas.resources(src, "sm_80") == first


@needs_nvcc
def test_nvcc_failure_is_a_runtime_error(tmp_path, monkeypatch):
    monkeypatch.setattr(ptxas, "CACHE", tmp_path / "ptxas")
    bad = tmp_path / "99_bad.cu"
    bad.write_text('#include "common.cuh"\n__global__ void k(float* x) { x[0] = undefined_name; }\n')
    with pytest.raises(RuntimeError, match=r"nvcc failed on .*99_bad\.cu for sm_80") as err:
        ptxas.resources(bad, "sm_80")
    assert "undefined_name" in str(err.value)
    assert not (tmp_path / "ptxas").exists() or not list((tmp_path / "ptxas").iterdir())


REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Function properties for _Z6helperf
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_80'
ptxas info    : Function properties for _Z3fooPf
    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 255 registers, 1024 bytes smem, 368 bytes cmem[0]
ptxas info    : Compile time = 12.5 ms
ptxas info    : Compiling entry function '_Z3barILi64EEvv' for 'sm_80'
ptxas info    : Function properties for _Z3barILi64EEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 352 bytes cmem[0]
ptxas info    : Compile time = 3.1 ms
"""


def test_parse_a_canned_report():
    foo, bar = ptxas.parse(REPORT, "sm_80")
    assert "foo" in foo.kernel and "bar" in bar.kernel
    assert (foo.arch, foo.registers, foo.smem_static_bytes) == ("sm_80", 255, 1024)
    assert (foo.stack_bytes, foo.spill_store_bytes, foo.spill_load_bytes) == (16, 12, 8)
    assert foo.spill_bytes == 20
    assert (bar.registers, bar.smem_static_bytes, bar.stack_bytes, bar.spill_bytes) == (40, 0, 0, 0)
    if shutil.which("cu++filt") or shutil.which("c++filt"):
        assert foo.kernel == "foo(float*)"
        assert bar.kernel == "void bar<64>()"


def test_parse_nothing():
    assert ptxas.parse("", "sm_90") == []
    assert ptxas.parse("ptxas info    : 0 bytes gmem\n", "sm_90") == []


# --- the generated binding ------------------------------------------------------------------------

@pytest.mark.skipif(GXX is None, reason="g++ not found")
def test_binding_compiles(tmp_path):
    from torch.utils.cpp_extension import include_paths
    src = tmp_path / "binding.cpp"
    src.write_text(build.BINDING)
    cmd = [GXX, "-std=c++17", "-fsyntax-only", "-Wall", *[f"-I{p}" for p in include_paths()],
           f"-I{sysconfig.get_paths()['include']}", "-I", str(KERNELS), "-DTORCH_EXTENSION_NAME=x",
           str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_binding_matches_the_abi():
    """The three functions of kernels/flashlab.h are the ones the binding calls."""
    header = (KERNELS / "flashlab.h").read_text()
    for fn in ("flashlab_unsupported", "flashlab_workspace_bytes", "flashlab_launch"):
        assert fn in header and f"{fn}(" in build.BINDING
    assert '#include "flashlab.h"' in build.BINDING
    assert "torch" not in build.BINDING.replace("TORCH_EXTENSION_NAME", "")


# --- compiler errors name the real file and line --------------------------------------------------

def _broken_copy(tmp_path, line=20):
    """01_naive.cu with a syntax error at `line` (1-based), written to tmp_path."""
    lines = fl.stage(1).source.read_text().splitlines()
    lines.insert(line - 1, "this line is not valid CUDA")
    bad = tmp_path / "01_naive.cu"
    bad.write_text("\n".join(lines) + "\n")
    return bad


@needs_nvcc
def test_nvcc_error_names_the_cu_file_and_line(tmp_path):
    """What build_module hands nvcc: a copy of the source behind '#line 1 "<real path>"'."""
    bad = _broken_copy(tmp_path, line=20)
    copy = tmp_path / "build" / "cuda.cu"
    copy.parent.mkdir()
    copy.write_text(f'#line 1 "{bad}"\n{bad.read_text()}')
    proc = subprocess.run([NVCC, "-c", *build.NVCC_FLAGS, "-arch=sm_80", "-I", str(KERNELS),
                           str(copy), "-o", str(tmp_path / "x.o")], capture_output=True, text=True)
    assert proc.returncode != 0
    lines = build._compiler_lines(proc.stdout + proc.stderr)
    assert lines.splitlines(), proc.stderr
    assert lines.splitlines()[0].startswith(f"{bad}(20): error"), lines
    assert all(ln.startswith(f"{bad}(") for ln in lines.splitlines()), lines  # never the copy
    assert "error" in lines


@needs_nvcc
def test_build_error_reports_the_cu_file_and_line(tmp_path, monkeypatch):
    """build_module end to end, with load_inline replaced by a plain nvcc compile of the CUDA
    source it is given (torch's CPU build cannot compile CUDA extensions)."""
    cpp_extension = importlib.import_module("torch.utils.cpp_extension")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))

    def fake_load_inline(name, cpp_sources, cuda_sources, extra_cuda_cflags, extra_include_paths,
                         **kwargs):
        src = tmp_path / f"{name}.cu"
        src.write_text(cuda_sources[0])
        inc = [f"-I{p}" for p in extra_include_paths]
        flags = [f for f in extra_cuda_cflags if not f.startswith("-gencode")]
        proc = subprocess.run([NVCC, "-c", *flags, "-arch=sm_80", *inc, str(src), "-o",
                               str(tmp_path / "x.o")], capture_output=True, text=True)
        raise RuntimeError(f"Error building extension '{name}':\n[1/3] nvcc ...\nFAILED: cuda.cuda.o\n"
                           f"{proc.stdout}{proc.stderr}\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    bad = _broken_copy(tmp_path, line=33)
    with pytest.raises(build.BuildError) as err:
        build.build_module(bad, arch="sm_80")
    msg = str(err.value)
    assert msg.startswith(f"building {bad} failed:")
    body = msg.splitlines()[1:]
    assert body and body[0].startswith(f"{bad}(33): error"), msg
    assert all(ln.startswith(f"{bad}(") for ln in body), msg
    assert "ninja" not in msg


def test_compiler_lines_falls_back_to_the_whole_message():
    assert build._compiler_lines("linker said no") == "linker said no"
    msg = "noise\n/x/kernels/03_coarsened.cu(12): error: bad\nmore noise\nflashlab.h:3:1: error: x"
    assert build._compiler_lines(msg).splitlines() == ["/x/kernels/03_coarsened.cu(12): error: bad",
                                                       "flashlab.h:3:1: error: x"]



def test_template_arguments_of_a_kernel_name():
    from flashlab.ptxas import template_args
    assert template_args("void coarsened_kernel<128, 64, 32>(const float*)") == ["128", "64", "32"]
    assert template_args("tuned_kernel<__half, 64, 128, 4, 2, 2, false, 29>") == \
        ["__half", "64", "128", "4", "2", "2", "false", "29"]
    assert template_args("naive_kernel(const float*, int)") == []


def test_kernel_names_spell_bools_as_cxxfilt_does(monkeypatch):
    monkeypatch.setattr(ptxas, "_demangle", lambda names: [
        "void tuned_kernel<__half, (int)64, (int)128, (bool)0, (int)29>(const __half *)",
        "void tuned_kernel<__half, (int)64, (int)64, (bool)1, (int)27>(const __half *)"])
    assert [ptxas.template_args(n) for n in ptxas.kernel_names(["a", "b"])] == [
        ["__half", "64", "128", "false", "29"], ["__half", "64", "64", "true", "27"]]


def test_parse_normalises_cuxxfilt_template_spelling(monkeypatch):
    from flashlab import ptxas
    monkeypatch.setattr(ptxas, "_demangle", lambda names: [
        "void coarsened_kernel<(int)64, (int)64, (int)64>(const float *, int)" for _ in names])
    report = ("ptxas info    : Compiling entry function '_Z1kILi64EEvv' for 'sm_90'\n"
              "ptxas info    : Function properties for _Z1kILi64EEvv\n"
              "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
              "ptxas info    : Used 112 registers, used 1 barriers\n")
    (r,) = ptxas.parse(report, "sm_90")
    assert r.kernel.startswith("void coarsened_kernel<64, 64, 64>")
    assert ptxas.template_args(r.kernel) == ["64", "64", "64"]


def test_two_kernels_that_differ_only_in_an_argument_pick_leaves_out_are_told_apart(tmp_path):
    """`launch<T, 128, 64, 1, 3>` leaves RETIRE to its default (0); the kernel it runs is the
    `…, 1, 3, 1, 0>` one, not the `…, 1, 3, 1, 1>` that `launch<T, 128, 64, 1, 3, 1, 1>` runs."""
    import types
    src = tmp_path / "09_defaults.cu"
    src.write_text(
        "template <typename T, int D, int BC, int WGS, int STAGES, int BLOCKS = 1,\n"
        "          int RETIRE = 0>\n"
        "static const char* launch(const FlashlabProblem* p, cudaStream_t s) { return 0; }\n\n"
        "// PICK: two shapes\ntemplate <typename T>\n"
        "static const char* pick(const FlashlabProblem* p, cudaStream_t s) {\n"
        "  if (p->causal && p->N < 1024) return launch<T, 128, 64, 1, 3, 1, 1>(p, s);\n"
        "  return launch<T, 128, 64, 1, 3>(p, s);\n}\n")
    st = types.SimpleNamespace(slug="09_defaults", source=src, text=src.read_text(),
                               template=fl.stage("09").template)
    kernels = [ptxas.KernelResources(f"wgmma_kernel<__half, 128, 64, 1, 3, 1, {r}, false>(int)",
                                     "sm_90a", 120 + r, 0, 0, 0, 0) for r in (0, 1)]
    at = {N: ptxas.kernel_at(st, kernels, fl.Config(1, 1, N, 128, True, "fp16")).registers
          for N in (512, 2048)}
    assert at == {512: 121, 2048: 120}
