"""The package's layers, read from the source with ast (imports inside functions count too):

  core     dtypes, configs, inputs, reference, build, the stage registry and its runtime, the
           exercise markers, check, bench, the recorded tables — imports nothing above it; the
           registry, the dtypes and the configs are plain data (PLAIN): no torch at import
  tools    runner, profile, ptxas, sass, plots, report, readme, cli, the autotune, ... — on the core
  lessons  the notebooks' helpers and their per-notebook diagrams and models
  course   exercises, labs, grading, the leaderboard, the student edition, and the `flashlab`
           entry point (__main__) that reaches them — on top: nothing below imports it

No module imports a layer above its own, and no chain of imports comes back to where it began.
A new module must be given a layer here.
"""
import ast
from pathlib import Path

import pytest

from flashlab import paths

PACKAGE = paths.ROOT / "flashlab"
LAYERS = {
    "core": ["paths", "dtypes", "configs", "env", "inputs", "reference", "build", "stages",
             "variants",
             "runtime", "check", "bench", "markers", "baselines", "profile_schema", "tables"],
    "tools": ["ptxas", "sass", "picks", "measure", "peaks", "profile",
              "profile_target", "worker", "runner", "plots", "report", "readme", "cli",
              "autotune", "model", "cells", "scaffold", "ring"],
    "lessons": ["notebook", "intro", "diagrams", "fragments", "tiling", "banks", "tuning",
                "hopper_common", "wgmma", "tma", "warpspec", "tma_store", "lazy_rescale",
                "backward", "backward_mma", "deterministic", "wide_warps", "dq_layout",
                "wgmma_backward", "warpspec_backward", "deterministic_hopper", "overlap_backward",
                "tma_store_backward",
                "ring_attention"],
    "course": ["course", "__main__"],
}
RANK = {name: i for i, name in enumerate(LAYERS)}
# Plain data: importing one imports no torch, pandas or numpy, at its top level or through the
# flashlab modules it imports there (what needs the GPU is reached inside a function, when called).
PLAIN = ["paths", "dtypes", "configs", "stages", "markers", "profile_schema"]
HEAVY = {"torch", "pandas", "numpy", "matplotlib", "triton"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict:
    """{dotted module name: its file} for every module of the package."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, node) -> list:
    """The flashlab modules one import statement names."""
    known = modules()
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "flashlab"]
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod.split(".")[0] != "flashlab":
        return []
    found = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
    if len(found) < len(node.names):  # a name imported from a module, not a submodule
        found.append(mod)
    return found


def edges() -> dict:
    """{module: the flashlab modules it imports}, a package's own __init__ standing for it."""
    out = {}
    for name, path in modules().items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets.update(_resolve(name, is_package, node))
        out[name] = targets - {name}
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    if module == "flashlab":
        return "tools"  # the package's facade: `import flashlab as fl`
    for name, members in LAYERS.items():
        if parts[1] in members:
            return name
    raise KeyError(module)


def test_every_module_has_a_layer():
    missing = [m for m in modules() if m != "flashlab" and m.split(".")[1] not in
               {x for members in LAYERS.values() for x in members}]
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    bad = [f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in edges().items()
           for t in sorted(targets) if RANK[layer(t)] > RANK[layer(m)]]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = edges()
    for start in graph:  # a path back to start through the import graph is a cycle
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    pytest.fail("import cycle: " + " -> ".join(path + [start]))
                if nxt not in seen and nxt in graph:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))


def test_the_course_layer_is_on_top():
    """The course modules and the entry point are course; nothing below imports them."""
    graph = edges()
    course = [m for m in graph if layer(m) == "course"]
    assert {"flashlab.course", "flashlab.__main__"} <= set(course)
    assert "flashlab.course.cli" in graph["flashlab.__main__"]
    below = [f"{m} imports {t}" for m, targets in graph.items() if layer(m) != "course"
             for t in targets if layer(t) == "course"]
    assert not below, "\n".join(below)


def test_the_rule_would_catch_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: on a toy package with these faults, they do."""
    pkg = tmp_path / "flashlab"
    (pkg / "notebook").mkdir(parents=True)
    (pkg / "course").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "tables.py").write_text("def f():\n    from .plots import g\n")  # core -> tools
    (pkg / "plots.py").write_text("from . import tables\n")
    (pkg / "notebook" / "__init__.py").write_text("from .view import x\n")
    (pkg / "notebook" / "view.py").write_text("from .. import plots\nx = 1\n")
    (pkg / "tiling.py").write_text("def f():\n    from .course import labs\n")  # lessons -> course
    (pkg / "course" / "__init__.py").write_text("")
    (pkg / "course" / "labs.py").write_text("from .. import tiling\n")
    (pkg / "course" / "exercises.py").write_text("from . import kernels\n")  # a cycle in course
    (pkg / "course" / "kernels.py").write_text("def f():\n    from .exercises import g\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    with pytest.raises(AssertionError, match="tables .core. imports flashlab.plots .tools."):
        test_no_module_imports_a_layer_above_its_own()
    with pytest.raises(AssertionError,
                       match="tiling .lessons. imports flashlab.course.labs .course."):
        test_no_module_imports_a_layer_above_its_own()
    with pytest.raises(pytest.fail.Exception, match="import cycle"):
        test_no_import_cycles()
    (pkg / "plots.py").write_text("")
    (pkg / "course" / "labs.py").write_text("")
    with pytest.raises(pytest.fail.Exception,
                       match="import cycle: flashlab.course.(exercises|kernels)"):
        test_no_import_cycles()


def test_no_module_imports_a_submodule_the_package_rebinds():
    """`flashlab.check`, `.bench`, `.stages` and `.reference` are functions on the package (the
    facade `fl.check(...)`), so `from .. import check` hands over the function, not the module,
    and `check.check(...)` fails only when that line runs (on a GPU, say). Import the names."""
    import types

    import flashlab
    rebound = {name for name in vars(flashlab) if (PACKAGE / f"{name}.py").exists()
               and not isinstance(getattr(flashlab, name), types.ModuleType)}
    assert {"check", "bench"} <= rebound
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and (node.module or "") in ("", "flashlab"):
                parent = name.split(".")[:len(name.split(".")) - node.level + (path.name == "__init__.py")]
                if parent != ["flashlab"]:
                    continue
                found += [f"{name}: from {'.' * node.level} import {a.name}" for a in node.names
                          if a.name in rebound]
    assert not found, found


def _top_level_imports(path: Path) -> set:
    """The modules a file imports at its top level (not inside a function), by their full name;
    a relative import resolved against the package."""
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_name(path).split(".")[:-node.level + (path.name == "__init__.py") or None]
                mod = ".".join(base + ([node.module] if node.module else []))
                out |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules() else mod
                        for a in node.names}
            else:
                out.add(node.module)
    return out


def test_the_registry_configs_and_dtypes_are_plain_data():
    """flashlab.stages, .configs and .dtypes (and what they import at their top level) import no
    torch, pandas or numpy: the registry is read by the scaffold, the editions and the tests
    without a GPU stack; a Stage's build() reaches flashlab.runtime when it is called."""
    known = modules()
    for name in PLAIN:
        assert f"flashlab.{name}" in known and layer(f"flashlab.{name}") == "core", name
        todo, seen = [f"flashlab.{name}"], set()
        while todo:
            mod = todo.pop()
            if mod in seen:
                continue
            seen.add(mod)
            for imp in _top_level_imports(known[mod]):
                assert imp.split(".")[0] not in HEAVY, f"{mod} imports {imp} (reached from {name})"
                if imp in known:
                    todo.append(imp)
