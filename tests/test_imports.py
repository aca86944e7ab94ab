"""The import graph of `rl_kernel` and `vime`, read from the source (ast), has no cycles, and `rl_kernel`
never imports `vime`.

Two graphs, both with an edge A -> B where a statement of module A imports module B:
- module level: the imports that run when A is imported (module body, its conditionals and class bodies;
  not function bodies, not `if TYPE_CHECKING:`). No cycle in either package.
- all imports: every import statement of A wherever it stands: inside functions, methods and classes
  (a deferred import is how a cycle gets hidden, not how it goes away) and under `if TYPE_CHECKING:`
  (a type-only dependency is still a dependency). No cycle in either package.
`from P import name` is an edge to the module `P.name` when there is one, else to `P`; importing a
submodule is no edge to its parent packages (Python runs them first, but they are not what the module
depends on). Only edges between modules of the two packages are kept.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx
import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rl_kernel", "vime")


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of PACKAGES (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _known(name: str) -> str | None:
    """The deepest module of MODULES that `name` is or lies in; None outside the packages."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module, module_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """A module's import statements: those that run on import (`module_level`), or all of them."""
    if not module_level:
        return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif _is_type_checking(node):
            todo += node.orelse
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):  # a class body runs on import
            todo += ast.iter_child_nodes(node)
    return found


def _imports(name: str, module_level: bool) -> set[str]:
    """Every module (of any package) that module `name` imports, by dotted name."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), module_level):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names)
    return found


@functools.cache
def _graph(module_level: bool) -> networkx.DiGraph:
    graph = networkx.DiGraph()
    graph.add_nodes_from(MODULES)
    for name in MODULES:
        for target in map(_known, _imports(name, module_level)):
            if target is not None and target != name:
                graph.add_edge(name, target)
    return graph


def _cycles(graph: networkx.DiGraph, package: str) -> set[tuple[str, ...]]:
    """The simple cycles among `package`'s modules, each rotated to start at its smallest name."""
    sub = graph.subgraph([n for n in graph if n.split(".")[0] == package])
    cycles = set()
    for cycle in networkx.simple_cycles(sub):
        i = cycle.index(min(cycle))
        cycles.add(tuple(cycle[i:] + cycle[:i]))
    return cycles


def test_the_graph_sees_the_modules_and_their_deferred_imports():
    """The scan is not vacuous: it finds both packages' modules and a known function-level edge."""
    assert {"rl_kernel.contracts", "rl_kernel.ops.spec", "vime.loop.driver", "vime.state.checkpoint"} <= set(MODULES)
    full, top = _graph(module_level=False), _graph(module_level=True)
    edge = ("vime.state.checkpoint", "vime.cluster.remote")
    assert full.has_edge(*edge) and not top.has_edge(*edge)
    assert top.has_edge("rl_kernel.ops.spec", "rl_kernel.contracts")


@pytest.mark.parametrize("package", PACKAGES)
def test_no_cycle_among_module_level_imports(package):
    assert _cycles(_graph(module_level=True), package) == set()


@pytest.mark.parametrize("package", PACKAGES)
def test_no_cycle_among_all_imports(package):
    cycles = _cycles(_graph(module_level=False), package)
    assert not cycles, f"import cycle(s) in {package}: {sorted(cycles)}; break them (move the shared code down a layer)"


def test_rl_kernel_never_imports_vime():
    found = {
        (name, target)
        for name in MODULES
        if name.split(".")[0] == "rl_kernel"
        for target in _imports(name, module_level=False)
        if target.split(".")[0] == "vime"
    }
    assert not found, f"rl_kernel depends on nothing of vime: {sorted(found)}"
