import importlib.util
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import flashlab as fl
from flashlab import paths, ptxas

HAVE_CUDA = torch.cuda.is_available()
try:
    NVCC = ptxas.nvcc()  # the compiler flashlab builds with; CPU tests compile with it too
except FileNotFoundError:
    NVCC = None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (no CUDA toolkit on PATH, "
                                "CUDA_HOME or /usr/local/cuda)")


def load_tool(name):
    """tools/<name>.py (a script, not a package module) imported as a module for its tests."""
    spec = importlib.util.spec_from_file_location(name, paths.ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def _stages_in(value):
    """The stage slugs a test parameter names: a Stage, a slug, a name of the stage's own
    ("15a_backward_log", "17.pair_operands", a notebook's path), or these inside a tuple/list."""
    if isinstance(value, fl.Stage):
        return {value.slug}
    if isinstance(value, (str, Path)):
        name = value.name if isinstance(value, Path) else value
        own = re.match(r"(\d\d)[a-z]?[_.]", name)
        return {NUMBERED[own.group(1)]} if own and own.group(1) in NUMBERED else set()
    if isinstance(value, (tuple, list)):
        return set().union(*map(_stages_in, value)) if value else set()
    return set()


NUMBERED = {f"{st.number:02d}": st.slug for st in fl.stages()}


def pytest_collection_modifyitems(config, items):
    only = os.environ.get("FLASHLAB_TEST_STAGES")
    if only:  # a stage's cases only (tests/test_new_stage.py): tests of every stage at once stay
        keep = {fl.stage(s).slug for s in only.split(",")}
        gone = [it for it in items if hasattr(it, "callspec")
                and (_stages_in(list(it.callspec.params.values())) - keep)]
        if gone:
            config.hook.pytest_deselected(items=gone)
            dropped = set(map(id, gone))
            items[:] = [it for it in items if id(it) not in dropped]
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def built():
    """The stages a GPU test module has built, by slug (attn_for): each is built once a module."""
    return {}


def attn_for(built, slug):
    """Stage `slug` built, from the module's `built` when it is there already; the test skipped
    where the stage cannot run (a Hopper stage before sm_90)."""
    if slug not in built:
        why = fl.stage(slug).unavailable(torch.cuda.get_device_capability())
        if why is not None:
            pytest.skip(why)
        built[slug] = fl.stage(slug).build()
    return built[slug]


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A private copy of data/ that FLASHLAB_DATA points at, so tests never touch the real one."""
    dst = tmp_path / "data"
    shutil.copytree(paths.ROOT / "data", dst)
    monkeypatch.setenv("FLASHLAB_DATA", str(dst))
    return dst


@pytest.fixture
def empty_data_dir(tmp_path, monkeypatch):
    dst = tmp_path / "data"
    dst.mkdir()
    monkeypatch.setenv("FLASHLAB_DATA", str(dst))
    return dst
