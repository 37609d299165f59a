"""Compile a stage's .cu file into a Python module with torch.utils.cpp_extension.load_inline.

The .cu files hold no torch code: just CUDA plus the three C functions of kernels/flashlab.h.
flashlab generates the binding — a few lines of pybind11 that pass raw pointers through — so
nvcc never sees a torch header and a cold build takes seconds. The module name carries a hash
of everything that goes into the build, so an edited kernel rebuilds and an unchanged one loads
from torch's extension cache.
"""
import hashlib
import os
import re
import shutil
from pathlib import Path

import torch

from .paths import KERNELS, kernel_inputs

BINDING = r"""
#include <cstdint>
#include <pybind11/pybind11.h>
#include "flashlab.h"
namespace py = pybind11;

static FlashlabStrides strides(const py::tuple& s) {
  return FlashlabStrides{s[0].cast<int>(), s[1].cast<int>(), s[2].cast<int>()};
}

// Contiguous strides unless `layout` (the (B, H, N) strides of q, k, v and o) says otherwise.
static FlashlabProblem problem(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t ws,
                               int B, int H, int N, int D, int dtype, bool causal, float scale,
                               py::object layout = py::none()) {
  // (dense strides fit an int whenever the problem can launch: B*H*N*D < 2^31, checked in Python)
  FlashlabStrides dense{(int)((long long)H * N * D), (int)((long long)N * D), D};
  FlashlabLayout lay{dense, dense, dense, dense, H};
  if (!layout.is_none()) {
    py::tuple t = layout.cast<py::tuple>();
    lay = FlashlabLayout{strides(t[0]), strides(t[1]), strides(t[2]), strides(t[3]), H};
  }
  return FlashlabProblem{(const void*)q, (const void*)k, (const void*)v, (void*)o, (void*)ws,
                         B, H, N, D, dtype, causal ? 1 : 0, scale, lay};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("unsupported", [](int B, int H, int N, int D, int dtype, bool causal) -> py::object {
    FlashlabProblem p = problem(0, 0, 0, 0, 0, B, H, N, D, dtype, causal, 1.f);
    const char* why = flashlab_unsupported(&p);
    if (why) return py::str(why);
    return py::none();
  });
  m.def("workspace_bytes", [](int B, int H, int N, int D, int dtype, bool causal) {
    FlashlabProblem p = problem(0, 0, 0, 0, 0, B, H, N, D, dtype, causal, 1.f);
    return flashlab_workspace_bytes(&p);
  });
  m.def("launch", [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t ws, int B,
                     int H, int N, int D, int dtype, bool causal, float scale, uintptr_t stream,
                     py::object layout, uintptr_t lse) {
    FlashlabProblem p = problem(q, k, v, o, ws, B, H, N, D, dtype, causal, scale, layout);
    p.lse = (float*)lse;
    const char* err = flashlab_launch(&p, (void*)stream);
    if (err) throw std::runtime_error(err);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("ws"), py::arg("B"),
     py::arg("H"), py::arg("N"), py::arg("D"), py::arg("dtype"), py::arg("causal"),
     py::arg("scale"), py::arg("stream"), py::arg("layout") = py::none(), py::arg("lse") = 0);
#ifdef FLASHLAB_BACKWARD
  m.attr("has_backward") = true;
  m.def("backward_workspace_bytes", [](int B, int H, int N, int D, int dtype, bool causal) {
    FlashlabProblem p = problem(0, 0, 0, 0, 0, B, H, N, D, dtype, causal, 1.f);
    return flashlab_backward_workspace_bytes(&p);
  });
  // q, k, v as `layout` says; o contiguous; dq, dk, dv and dout as `grad_layout` (their (B, H, N)
  // strides) says, contiguous without one; lse (B, H, N) fp32.
  m.def("backward", [](uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t o, uintptr_t lse,
                       uintptr_t dout, uintptr_t dq, uintptr_t dk, uintptr_t dv, uintptr_t ws,
                       int B, int H, int N, int D, int dtype, bool causal, float scale,
                       uintptr_t stream, py::object layout, py::object grad_layout) {
    FlashlabProblem p = problem(q, k, v, o, ws, B, H, N, D, dtype, causal, scale, layout);
    p.lse = (float*)lse;
    p.dout = (const void*)dout;
    p.dq = (void*)dq;
    p.dk = (void*)dk;
    p.dv = (void*)dv;
    p.dq_strides = p.dk_strides = p.dv_strides = p.dout_strides =
        FlashlabStrides{(int)((long long)H * N * D), (int)((long long)N * D), D};
    if (!grad_layout.is_none()) {
      py::tuple g = grad_layout.cast<py::tuple>();
      p.dq_strides = strides(g[0]);
      p.dk_strides = strides(g[1]);
      p.dv_strides = strides(g[2]);
      p.dout_strides = strides(g[3]);
    }
    const char* err = flashlab_backward_launch(&p, (void*)stream);
    if (err) throw std::runtime_error(err);
  }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse"), py::arg("dout"),
     py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("ws"), py::arg("B"), py::arg("H"),
     py::arg("N"), py::arg("D"), py::arg("dtype"), py::arg("causal"), py::arg("scale"),
     py::arg("stream"), py::arg("layout") = py::none(), py::arg("grad_layout") = py::none());
#else
  m.attr("has_backward") = false;
#endif
}
"""

NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]
# A .cu file that defines this has a backward pass: its binding gains backward() (FLASHLAB_BACKWARD).
_BACKWARD = re.compile(r'extern\s+"C"[^;{]*\bflashlab_backward_launch\s*\(')


def has_backward(text: str) -> bool:
    """Whether a stage's kernel source defines the backward entry of kernels/flashlab.h."""
    return _BACKWARD.search(text) is not None


def binding(backward=False) -> str:
    """The binding's source; with the backward entry for a stage that has one."""
    return ("#define FLASHLAB_BACKWARD 1\n" if backward else "") + BINDING


class BuildError(RuntimeError):
    """nvcc or the linker rejected a stage; the message holds the compiler's own lines."""


def nvcc():
    """Path of nvcc (CUDA_HOME, CUDA_PATH, /usr/local/cuda, then PATH), or None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def arch_flags(arch):
    """-gencode for one architecture: "sm_90" (or "sm_90a", whose arch-specific instructions run
    on that chip alone). Which architecture a stage needs is in its registry entry."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise ValueError(f"not an nvcc architecture: {arch!r} (e.g. sm_80, sm_90a)")
    cc = arch[len("sm_"):]
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def _headers(folder=KERNELS):
    folder = Path(folder)
    return {p.name: p.read_text() for p in sorted(folder.glob("*.h")) + sorted(folder.glob("*.cuh"))}


def _compiler_lines(message: str) -> str:
    """The lines of a failed build that name a file and line, else the whole message."""
    lines = [ln for ln in message.splitlines() if re.search(r"\.(cu|cuh|h|cpp)[(:]\d+", ln)]
    return "\n".join(lines) if lines else message


def _load_cached(name, verbose):
    """Import an already-built module directly. The name hashes every input of the build, so an
    existing library is up to date; this skips load_inline's rewrite-and-ninja pass (~1 s)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory, _import_module_from_library
        build_dir = _get_build_directory(name, verbose)
        if os.path.exists(os.path.join(build_dir, f"{name}.so")):
            return _import_module_from_library(name, build_dir, True)
    except Exception:  # a private API changed, or a half-written library: build normally
        return None
    return None


def build_module(source, verbose=False, arch=None, include_dir=None):
    """Compile `source` (a kernels/*.cu path) for `arch` (default: the GPU here, e.g. "sm_90")
    and return the loaded module. include_dir: where its headers (common.cuh, ...) are, default
    kernels/; another edition's kernels folder builds that edition's stage with its own headers."""
    from torch.utils.cpp_extension import load_inline

    source = os.fspath(source)
    text = open(source).read()
    if arch is None:
        if not torch.cuda.is_available():
            raise RuntimeError("building a stage needs a CUDA GPU (none is visible to torch)")
        arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
    flags = NVCC_FLAGS + arch_flags(arch)
    digest = hashlib.sha256()
    include_dir = Path(include_dir) if include_dir is not None else KERNELS
    bind = binding(has_backward(text))
    for part in [text, bind, repr(flags), torch.__version__, *_headers(include_dir).values()]:
        digest.update(part.encode())
    for included in kernel_inputs(source, include_dir)[1:]:  # stage files it includes whole
        if included.suffix == ".cu":
            digest.update(included.read_bytes())
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(source))[0])
    name = f"flashlab_{stem}_{digest.hexdigest()[:12]}"
    # '#line' makes nvcc report errors against the real file, not the copy in the build folder.
    cuda_source = f'#line 1 "{source}"\n{text}'
    cached = _load_cached(name, verbose)
    if cached is not None:
        return cached
    try:
        return load_inline(
            name=name,
            cpp_sources=[bind],
            cuda_sources=[cuda_source],
            extra_cflags=["-O2"],
            extra_cuda_cflags=flags,
            extra_include_paths=[str(include_dir)],
            extra_ldflags=["-Wl,-Bsymbolic"],  # each stage calls its own flashlab_launch
            with_cuda=True,
            no_implicit_headers=True,
            verbose=verbose,
        )
    except RuntimeError as err:
        raise BuildError(f"building {source} failed:\n{_compiler_lines(str(err))}") from err
