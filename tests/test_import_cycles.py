"""No import cycles inside lowbit_compile: its modules form a layered graph (DESIGN.md: the API over
passes over kernels), so any module can be read, imported and tested knowing only those below it.

The graph is read with ``ast`` from every relative import (``from . import x``, ``from .x import y``,
``from ..x import y``) and every absolute ``lowbit_compile.*`` import, top-level and inside functions
alike: a lazy import inside a function hides a cycle from the interpreter's import order, not from
the design (the two modules still need each other), so it counts. Imports under ``TYPE_CHECKING``
are annotations only and do not count. A module importing its own package's ``__init__`` (the lazy
public names) does not count either: the package's face imports everything by design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import lowbit_compile

PACKAGE = Path(lowbit_compile.__file__).parent


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree`` except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a ``from .pkg import name`` names the submodule
    ``pkg.name`` when there is one, else ``pkg``)."""
    modules = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = name.split(".")
                    base = base[:len(base) - node.level + (1 if is_package else 0)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                targets = [f"{base_name}.{a.name}" if f"{base_name}.{a.name}" in modules else base_name
                           for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` imports a.b.c's module
                    target = target.rpartition(".")[0]
                if target and target != name and target != package.name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_lowbit_compile_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "lowbit_compile.api" in graph and graph["lowbit_compile.api"], "the graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_top_level_and_lazy_imports(tmp_path: Path) -> None:
    """The check can fail: a two-module cycle through a function-level import is found, one under
    TYPE_CHECKING is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("from .c import z\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("")
    assert find_cycle(import_graph(pkg)) is None


# The wings, lowest first (DESIGN.md): a module imports only modules of its own wing or of lower ones. The
# modules at the package root are the API but for what the user gives: the option schema (options.py, which
# imports nothing) below everything, the validated configuration and the param-group checks (config.py,
# param_groups.py) over the passes and kernels they read; kernels/ and passes/ stand side by side, on ir/.
WINGS = ("options", "formats", "ir", "kernels|passes", "config", "state", "runtime", "api")


def wing(module: str) -> int:
    parts = module.split(".")[1:]
    if not parts:
        return WINGS.index("api")
    if parts[0] in ("kernels", "passes"):
        return WINGS.index("kernels|passes")
    if parts == ["options"]:
        return WINGS.index("options")
    if parts in (["config"], ["param_groups"]):
        return WINGS.index("config")
    return WINGS.index(parts[0]) if parts[0] in WINGS else WINGS.index("api")


def test_the_wings_point_one_way() -> None:
    """options <- formats <- ir <- kernels, passes <- config <- state <- runtime <- the API: no module imports one of
    a higher wing, and kernels/ and passes/ import each other's modules nowhere."""
    upward = [f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
              if wing(t) > wing(m) or (wing(t) == wing(m) == WINGS.index("kernels|passes")
                                       and m.split(".")[1] != t.split(".")[1])]
    assert upward == []
