"""Reach (issue 13 §4): stages 01-04 run live on compute capability 7.5 (a T4, as on free Colab) —
the fp32 stages and stage 04 in fp16; bf16 WMMA needs 8.0. What the registry says per dtype, what
a 7.5 GPU builds, and nvcc building stages 01-04 for sm_75 (no GPU needed)."""
import importlib
import re
import shutil
import subprocess

import pytest
import torch

import flashlab as fl
from flashlab import build, diagrams, ptxas, tiling
from flashlab.paths import KERNELS

runtime = importlib.import_module("flashlab.runtime")

from test_ptxas import NVCC, needs_nvcc  # noqa: E402  (one definition of "nvcc is here")

T4 = (7, 5)
T4_SMEM = 64 * 1024  # the most shared memory a block may have on compute capability 7.5
ON_T4 = ["01_naive", "02_coalesced", "03_coarsened", "04_wmma"]
BF16 = "04_wmma bf16 needs compute capability 8.0 or newer; this GPU is 7.5"


# --- the registry, per dtype ----------------------------------------------------------------------

def test_stages_01_to_04_run_on_a_t4():
    runs = [st.slug for st in fl.stages() if st.unavailable(T4, toolkit=False) is None]
    assert runs[:len(ON_T4)] == ON_T4  # a stage added later may run there too (one built on 03)
    assert not {st.slug for st in fl.stages() if 5 <= st.number <= 13} & set(runs)
    assert [st.dtypes_on(T4) for st in map(fl.stage, ON_T4)] == [("fp32",)] * 3 + [("fp16",)]
    assert fl.stage("04_wmma").dtypes_on((8, 0)) == ("fp16", "bf16")
    assert fl.stage("05_mma").dtypes_on(T4) == ()


@pytest.mark.parametrize("cc, bf16", [((7, 5), BF16), ((8, 0), None), ((9, 0), None)])
def test_stage_04_says_per_dtype_what_it_needs(cc, bf16):
    st = fl.stage("04_wmma")
    assert st.unavailable(cc, toolkit=False) is None  # the stage runs (fp16 at least)
    assert st.unavailable(cc, toolkit=False, dtype="fp16") is None
    assert st.unavailable(cc, toolkit=False, dtype="bf16") == bf16
    assert st.unavailable_dtypes(cc) == ({} if bf16 is None else {"bf16": bf16})
    assert st.availability(cc) == ("runs live" if bf16 is None else f"runs live in fp16; {bf16}")
    assert st.min_cc_of("fp16") == (7, 5) and st.min_cc_of("bf16") == (8, 0)


@pytest.mark.parametrize("cc", [(7, 5), (8, 0), (9, 0)])
def test_the_other_stages_need_the_same_in_every_dtype(cc):
    for st in fl.stages():
        if st.slug == "04_wmma":
            continue
        stage_why = st.unavailable(cc, toolkit=False)
        for dt in st.dtypes:
            assert st.unavailable(cc, toolkit=False, dtype=dt) == stage_why, (st.slug, dt)
        assert st.unavailable_dtypes(cc) == {}


def test_below_the_stage_minimum_the_stage_itself_is_named():
    st = fl.stage("04_wmma")
    why = "04_wmma needs compute capability 7.5 or newer; this GPU is 7.0"
    assert st.unavailable((7, 0), toolkit=False) == why
    assert st.unavailable((7, 0), toolkit=False, dtype="bf16") == why
    assert st.unavailable_dtypes((7, 0)) == {}
    assert st.availability((7, 0)) == f"replayed: {why}"
    assert fl.stage("05_mma").unavailable(T4, toolkit=False, dtype="fp16") == \
        "05_mma needs compute capability 8.0 or newer; this GPU is 7.5"
    assert st.unavailable(T4, toolkit=False, dtype="fp32") == "04_wmma takes fp16 or bf16, not fp32"


@pytest.mark.parametrize("st", fl.stages(), ids=lambda st: st.slug)
def test_every_dtype_minimum_is_a_dtype_of_the_stage_above_its_minimum(st):
    for dt, cc in st.dtype_min_cc.items():
        assert dt in st.dtypes, (st.slug, dt)
        assert len(cc) == 2 and tuple(cc) > tuple(st.min_cc), (st.slug, dt, cc)
    assert st.dtypes_on(st.min_cc), f"{st.slug} runs in no dtype at its own minimum"


@pytest.fixture
def a_t4(monkeypatch):
    """A GPU of compute capability 7.5, with nvcc."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: T4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(build, "nvcc", lambda: "/usr/local/cuda/bin/nvcc")


@pytest.mark.parametrize("slug", ON_T4)
def test_a_t4_builds_for_sm_75(slug, a_t4, monkeypatch):
    asked = []
    monkeypatch.setattr(build, "build_module", lambda source, verbose=False, arch=None:
                        asked.append((source, arch)) or object())
    st = fl.stage(slug)
    assert st.unavailable() is None
    st.build()
    assert asked == [(st.source, "sm_75")]
    assert build.arch_flags("sm_75") == ["-gencode=arch=compute_75,code=sm_75"]


def test_bf16_on_a_t4_is_refused_before_any_kernel_runs(a_t4, monkeypatch):
    class Module:  # what a built stage's module would do: nothing may reach it
        def __getattr__(self, name):
            pytest.fail(f"the kernel module was called ({name}) for bf16 on a T4")

    monkeypatch.setattr(runtime, "validate", lambda *args, **kwargs: None)  # CPU tensors here
    attn = runtime.Attention(fl.stage("04_wmma"), Module())
    q = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(BF16)):
        attn(q, q, q)


def test_a_t4_checks_stage_04_in_fp16_only(a_t4, monkeypatch):
    seen = []

    def attn(q, k, v, causal=False, out=None):
        seen.append(q.dtype)
        return out.copy_(fl.reference(q, k, v, causal=causal).to(q.dtype))

    attn.stage = fl.stage("04_wmma")
    real_generator = torch.Generator
    monkeypatch.setattr(torch, "Generator", lambda device=None: real_generator())
    real_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, device=None, **kw: real_randn(*a, **kw))
    monkeypatch.setattr(torch, "full_like", lambda t, x: torch.empty_like(t).fill_(x))
    result = fl.check(attn, shapes=((1, 1, 17),), head_dims=(64,), causal=(False,))
    assert set(seen) == {torch.float16} and {c.dtype for c in result.cases} == {"fp16"}


# --- nvcc builds 01-04 for sm_75 --------------------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("slug", ON_T4)
def test_stage_compiles_for_sm_75_without_spills(slug, tmp_path, monkeypatch):
    monkeypatch.setattr(ptxas, "CACHE", tmp_path)
    st = fl.stage(slug)
    assert st.arch(T4) == "sm_75"
    found = ptxas.resources(st.source, "sm_75")
    assert found, f"ptxas reported no kernel in {slug} for sm_75"
    for k in found:
        assert k.arch == "sm_75" and 0 < k.registers <= 255, k
        assert k.spill_bytes == 0 and k.stack_bytes == 0, f"{slug} spills on sm_75: {k}"


def _template(kernel, st):
    return dict(zip(st.template, ptxas.template_args(kernel)))


@needs_nvcc
@pytest.mark.parametrize("slug", ["03_coarsened", "04_wmma"])
def test_sm_75_kernels_fit_a_t4s_shared_memory(slug, tmp_path, monkeypatch):
    """A T4 gives a block 64 KiB: the sm_75 build launches shorter K/V tiles than sm_80's, one
    kernel per head dim, and stage 04 has no bf16 kernel there (bf16 WMMA needs sm_80)."""
    monkeypatch.setattr(ptxas, "CACHE", tmp_path)
    st = fl.stage(slug)
    smem = tiling.smem_bytes if slug == "03_coarsened" else diagrams.wmma_smem_bytes
    kernels = [_template(k.kernel, st) for k in ptxas.resources(st.source, "sm_75")]
    assert sorted(int(t["D"]) for t in kernels) == [64, 128]
    for t in kernels:
        assert smem(D=int(t["D"]), BR=int(t["BR"]), BC=int(t["BC"])) <= T4_SMEM, t
        assert t.get("T", "__half") == "__half", f"{slug} has a {t['T']} kernel for sm_75"
    wide = [_template(k.kernel, st) for k in ptxas.resources(st.source, "sm_80")]
    assert any(smem(D=int(t["D"]), BR=int(t["BR"]), BC=int(t["BC"])) > T4_SMEM for t in wide)
    if "T" in st.template:
        assert {t["T"] for t in wide} == {"__half", "__nv_bfloat16"}


@needs_nvcc
@pytest.mark.parametrize("slug", ON_T4)
def test_host_and_device_passes_agree_on_the_sm_75_kernels(slug, tmp_path):
    """A full compile (host code too, as torch's build does) for sm_75: the kernels the host code
    launches are the kernels compiled for the device (the choice is made with __CUDA_ARCH_LIST__,
    which both passes see alike)."""
    st = fl.stage(slug)
    obj = tmp_path / f"{slug}.o"
    proc = subprocess.run([NVCC, "-c", *build.NVCC_FLAGS, *build.arch_flags("sm_75"), "-I",
                           str(KERNELS), str(st.source), "-o", str(obj)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    nm = shutil.which("nm")
    if nm is None or not st.template:
        return
    symbols = subprocess.run([nm, "-C", str(obj)], capture_output=True, text=True).stdout
    host = {re.sub(r"\s+", "", m) for m in re.findall(rf"\b{st.kernel}<([^>]*)>", symbols)}
    device = {",".join(ptxas.template_args(k.kernel)).replace(" ", "")
              for k in ptxas.resources(st.source, "sm_75")}
    assert host == device, (host, device)


# --- what a T4's notebook and run say about bf16 ----------------------------------------------------

def test_stage_04s_notebook_runs_live_on_a_t4_and_says_why_not_bf16(a_t4, empty_data_dir, capsys):
    import pandas as pd

    from flashlab import notebook as nb
    from flashlab import tables
    from flashlab.notebook import measured
    nb.banner("04_wmma")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("LIVE on Tesla T4") and tables.live("04_wmma")
    assert f"{BF16}: bf16 is not run here." in out
    ev = measured.Evaluation("04_wmma", True, pd.DataFrame(), pd.DataFrame())
    assert ev.timing("bf16", missing_ok=True) is None
    assert capsys.readouterr().out.strip() == f"{BF16}: bf16 is not run here"
    nb.banner("01_naive")
    assert "not run here" not in capsys.readouterr().out


def test_measuring_stage_04_on_a_t4_leaves_bf16_out(a_t4, monkeypatch):
    from flashlab import measure
    from flashlab.configs import teaching
    timed, lines = [], []

    class Passed:
        passed, max_rel_err = True, 0.0

        def rows(self):
            return []

    def bench(attn, cfg):
        timed.append(cfg.dtype)
        return {"median_ms": 1.0, "tflops": 1.0, "rel_err": 0.0}

    monkeypatch.setattr(measure, "check", lambda attn: Passed())
    monkeypatch.setattr(measure, "bench", bench)
    monkeypatch.setattr(measure.ptxas, "summary", lambda *args, **kwargs: {})
    st = fl.stage("04_wmma")
    measure.measure_stage(st, configs=[teaching(dt) for dt in st.dtypes], record=False,
                          log=lines.append, attn=object())
    assert timed == ["fp16"]
    assert f"{BF16}: not checked or timed here" in lines
