"""How the package's modules import one another: without a circle, and the two stages
(``generation``, ``hidden_states``) never one the other: what both need of the servers is
``eagle3data.servers``. Every import statement counts, at module level or inside a function
(a lazy import still ties the two modules together), read from the source with ``ast``; the
strongly connected components come from networkx."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
from support.workflow import REPO

SRC = REPO / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``module``'s source imports (``from . import x`` names the
    submodule ``x`` where there is one, else the package)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known
            found |= submodules or ({target} & known)
    return found - {module}


def import_graph() -> nx.DiGraph:
    paths = {module_name(p): p for p in (SRC / "eagle3data").rglob("*.py")}
    graph = nx.DiGraph()
    for module, path in paths.items():
        graph.add_node(module)
        for imported in imported_modules(
            path.read_text(), module, path.name == "__init__.py", set(paths)
        ):
            graph.add_edge(module, imported)
    return graph


def circles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_no_module_imports_itself_through_others() -> None:
    found = circles(import_graph())
    assert found == [], "import circles (each a group of modules that import one another)"


STAGES = ("eagle3data.generation", "eagle3data.hidden_states")


def stage_of(module: str) -> str | None:
    return next((s for s in STAGES if module == s or module.startswith(s + ".")), None)


def test_neither_stage_imports_the_other() -> None:
    crossing = sorted(
        f"{a} imports {b}"
        for a, b in import_graph().edges
        if stage_of(a) and stage_of(b) and stage_of(a) != stage_of(b)
    )
    assert crossing == []


def test_the_check_sees_lazy_and_relative_imports() -> None:
    known = {"p", "p.a", "p.b", "p.sub", "p.sub.c"}
    a = "from . import b\n"
    b = "def f():\n    from .sub import c\n"
    c = "from ..a import x\n"
    graph = nx.DiGraph()
    for module, source, is_package in (("p.a", a, False), ("p.b", b, False), ("p.sub.c", c, False)):
        graph.add_edges_from(
            (module, m) for m in imported_modules(source, module, is_package, known)
        )
    assert circles(graph) == [["p.a", "p.b", "p.sub.c"]]
