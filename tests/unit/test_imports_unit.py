"""The import graph of the ftbundle package has no cycle.

Built from the source with ``ast`` (nothing is imported): every ``import`` and ``from ...
import`` of every module, at any depth (inside functions and ``if TYPE_CHECKING:`` too),
relative imports resolved, ``from pkg import mod`` counted as importing ``pkg.mod`` (and
``from pkg import name`` as importing ``pkg``, its ``__init__.py``). A package's
``__init__.py`` is a module of its own: ``ftbundle.export`` is ``export/__init__.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ftbundle"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the package."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its source."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def known(target: str) -> str | None:
        while target and target not in mods:  # `import ftbundle.x.y` of a name: its nearest module
            target = target.rpartition(".")[0]
        return target or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ftbundle" and (t := known(alias.name)):
                    found.add(t)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "ftbundle":
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in mods:  # from pkg import mod
                    found.add(f"{source}.{alias.name}")
                elif t := known(source):
                    found.add(t)
    found.discard(name)
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    mods = module_files(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), sorted: the
    modules that reach each other through their imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def cycle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """A concrete path start -> ... -> start inside one component, for the message."""
    start, members = comp[0], set(comp)
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        if start in nxt and len(path) > 1:
            return path + [start]
        step = next((w for w in nxt if w not in seen), None)
        if step is None:
            return comp  # no simple path printed; the component says enough
        path.append(step)
        seen.add(step)


def test_graph_resolves_relative_and_package_imports(tmp_path):
    """The graph builder sees what the cycle check relies on: relative imports, `from pkg
    import mod`, a name from a package's __init__, and imports inside functions."""
    pkg = tmp_path / "ftbundle"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import X\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import Y\n")
    (pkg / "c.py").write_text("import ftbundle.sub.b\nfrom ftbundle.a import f\n")
    graph = import_graph(pkg)
    assert graph["ftbundle.a"] == {"ftbundle.sub.b"}
    assert graph["ftbundle.sub"] == {"ftbundle.sub.b"}
    assert graph["ftbundle.sub.b"] == {"ftbundle.a", "ftbundle.sub"}
    assert graph["ftbundle.c"] == {"ftbundle.sub.b", "ftbundle.a"}
    cycles = find_cycles(graph)
    assert cycles == [["ftbundle.a", "ftbundle.sub", "ftbundle.sub.b"]]
    assert cycle_in(graph, cycles[0]) == ["ftbundle.a", "ftbundle.sub.b", "ftbundle.a"]


def test_no_import_cycle():
    graph = import_graph()
    assert "ftbundle.cli" in graph and "ftbundle.export" in graph  # the walk found the package
    cycles = find_cycles(graph)
    if cycles:
        pytest.fail("import cycles in ftbundle:\n" + "\n".join(
        f"  {', '.join(c)}: e.g. {' -> '.join(cycle_in(graph, c))}" for c in cycles),
                    pytrace=False)
