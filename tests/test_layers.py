"""The package layers, read from the source with `ast` (no import is executed).

Run alone: `.venv/bin/python -m pytest tests/test_layers.py`. Every import counts,
including those inside functions: a late import is still a dependency.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from layout import FOLDERS

ROOT = Path(__file__).resolve().parent.parent
# Each package may import only packages on a lower floor (and itself).
FLOORS = {
    "engine": 0,
    "exporters": 1,
    "dashboard": 2,
    "grafana": 2,
    "demo": 3,
    "replay": 3,
    "server": 4,
}
# The vLLM adapters, plus the version check that must run before any of them.
VLLM_IMPORTERS = {
    "kvlease.engine.runtime",  # the version check
    "kvlease.engine.vllm_scheduler",  # the scheduler adapter
    "kvlease.server.serve",  # the launcher
    "kvlease.exporters.stat_logger",  # the stat-logger plugin
    "kvlease.replay.synthetic",  # the offline engine of `kvlease replay`
}


def _modules() -> dict[str, Path]:
    out = {}
    for package in FLOORS:
        for path in sorted((ROOT / package).glob("*.py")):
            name = f"kvlease.{package}"
            out[name if path.stem == "__init__" else f"{name}.{path.stem}"] = path
    return out


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every module `name` imports, as a dotted name (`from a import b` counts as a.b when
    a.b is a module of ours, else as a)."""
    tree = ast.parse(MODULES[name].read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


IMPORTS = {name: _imports(name) for name in MODULES}


def _package(name: str) -> str:
    """kvlease.engine.policy -> engine."""
    return name.split(".")[1]


def _ours(imports: set[str]) -> set[str]:
    return {i for i in imports if i.startswith("kvlease.")}


def test_every_first_party_import_goes_through_the_namespace():
    python = [*ROOT.glob("kvlease/*.py"), *MODULES.values(), *ROOT.glob("tests/**/*.py")]
    python += [*ROOT.glob("bench/*.py")]
    bare = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in python
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
        if name.split(".")[0] in FLOORS
    ]
    assert bare == []


def test_every_installed_folder_has_a_floor():
    assert set(FLOORS) == set(FOLDERS)  # pyproject's package-dir and these floors agree


def test_packages_import_only_downward():
    upward = [
        f"{name} imports {dep}"
        for name, imports in IMPORTS.items()
        for dep in _ours(imports)
        if FLOORS[_package(dep)] > FLOORS[_package(name)]
    ]
    assert upward == []


def test_no_import_circle_between_modules():
    graph = {name: {d for d in _ours(imports) if d in MODULES} for name, imports in IMPORTS.items()}
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                circles.append(" -> ".join([*path[path.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert circles == []


def test_only_the_named_adapters_import_vllm():
    importers = {
        name for name, imports in IMPORTS.items() if any(i.split(".")[0] == "vllm" for i in imports)
    }
    assert importers == VLLM_IMPORTERS


@pytest.mark.parametrize("package", ["dashboard", "grafana"])
def test_the_dashboards_never_import_the_scheduler_adapter(package):
    for name, imports in IMPORTS.items():
        if _package(name) == package:
            assert "kvlease.engine.vllm_scheduler" not in imports, name


def test_the_policy_imports_only_the_standard_library():
    assert {i.split(".")[0] for i in IMPORTS["kvlease.engine.policy"]} <= set(
        sys.stdlib_module_names
    )


def test_no_exporter_imports_the_http_layer():
    for name, imports in IMPORTS.items():
        if _package(name) == "exporters":
            assert not any(i.startswith("kvlease.server") for i in imports), name


def test_the_readme_names_the_same_vllm_importers():
    readme = (ROOT / "README.md").read_text()
    listed = readme.split("**vLLM is imported by these modules only**")[1].split("\n\n")[1]
    named = {line.split("`")[1] for line in listed.splitlines() if line.startswith("- `")}
    assert named == VLLM_IMPORTERS
